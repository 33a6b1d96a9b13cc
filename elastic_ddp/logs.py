"""Rank-aware logging: every line carries ``[run_id/rank step]``.

:func:`setup_logging` installs one handler on the ``elastic_ddp`` logger tree (and the
root logger for scripts built on the runtime) with a filter that stamps each record with
the run, the rank and the current step. The trainer moves the step with
:meth:`LogContext.set_step`. :func:`main_only` gives a logger for lines that every rank
would otherwise repeat.
"""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(asctime)s %(levelname)s [%(run_id)s/%(rank)s %(step)s] %(name)s: %(message)s"


class LogContext(logging.Filter):
    """Stamps records with run id, rank and step; attached to the handlers it installs."""

    def __init__(self, run_id: str, rank: int) -> None:
        super().__init__()
        self.run_id = run_id
        self.rank = rank
        self.step: int | None = None
        self.handlers: list[logging.Handler] = []

    def set_step(self, step: int | None) -> None:
        self.step = step

    def filter(self, record: logging.LogRecord) -> bool:
        record.run_id = self.run_id
        record.rank = self.rank
        record.step = "-" if self.step is None else self.step
        return True

    def close(self) -> None:
        """Remove and close the handlers this context installed."""
        root = logging.getLogger()
        for handler in self.handlers:
            root.removeHandler(handler)
            handler.close()
        self.handlers.clear()


def setup_logging(
    run_id: str, rank: int, level: str = "INFO", log_dir: str = "", per_rank_files: bool = False
) -> LogContext:
    """Send log records to stderr (and optionally ``<log_dir>/rank-<N>.log``) with the rank prefix."""
    context = LogContext(run_id, rank)
    formatter = logging.Formatter(_FORMAT)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if per_rank_files:
        os.makedirs(log_dir, exist_ok=True)
        handlers.append(logging.FileHandler(os.path.join(log_dir, f"rank-{rank}.log")))
    root = logging.getLogger()
    for handler in handlers:
        handler.setFormatter(formatter)
        handler.addFilter(context)
        root.addHandler(handler)
    context.handlers = handlers
    root.setLevel(logging.WARNING)
    logging.getLogger("elastic_ddp").setLevel(level)
    logging.getLogger("__main__").setLevel(level)
    return context


class _MainOnly(logging.LoggerAdapter):
    """A logger adapter that drops records on every rank but 0."""

    def __init__(self, logger: logging.Logger, rank: int) -> None:
        super().__init__(logger, {})
        self.rank = rank

    def isEnabledFor(self, level: int) -> bool:
        return self.rank == 0 and self.logger.isEnabledFor(level)

    def log(self, level: int, msg: object, *args: object, **kwargs: object) -> None:
        if self.isEnabledFor(level):
            self.logger.log(level, msg, *args, stacklevel=2, **kwargs)


def main_only(logger: logging.Logger, rank: int) -> logging.LoggerAdapter:
    """A view of ``logger`` that only rank 0 writes to."""
    return _MainOnly(logger, rank)
