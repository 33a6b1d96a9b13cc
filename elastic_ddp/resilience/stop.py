"""Stop requests: SIGTERM/SIGINT and cloud spot-interruption notices become a flag that the
trainer agrees on with every rank at the next step boundary.

A request is only recorded here (no I/O, no locks in the signal handler); acting on it —
finishing the step, saving, exiting — is the trainer's job, at one decision point. A second
signal of the same kind restores the default handler and re-delivers the signal, so an
impatient operator can still kill the process.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import urllib.error
import urllib.request
from types import FrameType

logger = logging.getLogger(__name__)

AWS_SPOT_URL = "http://169.254.169.254/latest/meta-data/spot/instance-action"
GCP_PREEMPTED_URL = "http://metadata.google.internal/computeMetadata/v1/instance/preempted"
SPOT_URL_ALIASES = {"aws": AWS_SPOT_URL, "gcp": GCP_PREEMPTED_URL}


class StopRequests:
    """The local stop flag: set by signals or pollers, read by the trainer once per step."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.reason is not None

    def request(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason

    def install_signal_handlers(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        """Route SIGTERM/SIGINT to :meth:`request` (main thread only; a no-op elsewhere)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in signals:
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def restore_signal_handlers(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)  # type: ignore[arg-type]
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.reason is not None and self.reason == f"signal:{name}":
            signal.signal(signum, signal.SIG_DFL)  # second time: let it act as usual
            os.kill(os.getpid(), signum)
            return
        self.request(f"signal:{name}")


class SpotNoticePoller:
    """Polls an instance-metadata URL and raises a stop request when an interruption is announced.

    AWS answers 404 until a spot interruption is scheduled, then 200 with a JSON body; GCP's
    ``instance/preempted`` answers ``TRUE`` once the VM is being preempted (it needs the
    ``Metadata-Flavor: Google`` header, which is always sent). Any other 200 answer with a
    non-empty body that is not ``FALSE`` counts as a notice. Polling errors are logged once per
    kind and polling goes on: a flaky metadata endpoint must not stop training.
    """

    def __init__(self, url: str, interval_s: float, stop: StopRequests, timeout_s: float = 2.0) -> None:
        self.url = SPOT_URL_ALIASES.get(url, url)
        self.interval_s = interval_s
        self.timeout_s = min(timeout_s, interval_s)
        self.stop = stop
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastic-ddp-spot-poller", daemon=True)
        self._seen_errors: set[str] = set()

    def start(self) -> SpotNoticePoller:
        self._thread.start()
        return self

    def close(self) -> None:
        self._halt.set()
        self._thread.join(timeout=self.timeout_s + 1)

    def _run(self) -> None:
        while not self._halt.is_set() and not self.stop.requested:
            notice = self.check()
            if notice:
                logger.warning("spot interruption notice from %s: %s", self.url, notice[:200])
                self.stop.request("spot-notice")
                return
            self._halt.wait(self.interval_s)

    def check(self) -> str | None:
        """One poll: the notice text, or None when there is none (or the endpoint failed)."""
        request = urllib.request.Request(self.url, headers={"Metadata-Flavor": "Google"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                body = response.read(4096).decode("utf-8", "replace").strip()
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                self._log_once(f"HTTP {exc.code}")
            return None
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            self._log_once(type(exc).__name__)
            return None
        return body if body and body.upper() != "FALSE" else None

    def _log_once(self, kind: str) -> None:
        if kind not in self._seen_errors:
            self._seen_errors.add(kind)
            logger.warning("spot notice endpoint %s failed (%s); still polling", self.url, kind)
