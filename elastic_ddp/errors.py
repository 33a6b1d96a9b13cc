"""One exception hierarchy for the runtime.

Every error the runtime raises on purpose derives from :class:`ElasticDDPError`,
so callers (and the CLI) can tell "the runtime refused something, with a reason"
from a bug. Messages name what they are about (flag, path, rank, endpoint) and,
where it is not obvious, what to do.
"""

from __future__ import annotations


class ElasticDDPError(Exception):
    """Base class of every error raised on purpose by elastic_ddp."""


class ConfigError(ElasticDDPError, ValueError):
    """One or more configuration values are invalid; the message lists all of them."""


class DistributedInitError(ElasticDDPError):
    """The process group could not be formed (a peer or the store was unreachable in time)."""


class DataError(ElasticDDPError):
    """The dataset and the sampler settings cannot work together, or a batch broke the data contract."""


class CheckpointError(ElasticDDPError):
    """A checkpoint could not be written, read or trusted."""


class CheckpointStorageError(CheckpointError):
    """The checkpoint store failed an operation (I/O error, endpoint unreachable, access denied)."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's manifest or one of its files does not verify."""


class CheckpointConflictError(CheckpointError):
    """Another writer already committed the same step (create-only manifest lost the race)."""


class NoValidCheckpointError(CheckpointError):
    """Checkpoints exist but none verifies, and starting fresh was not allowed."""


class IncompatibleCheckpointError(CheckpointError):
    """A checkpoint was made with a config that cannot be resumed by this run."""


class ResumeRefusedError(IncompatibleCheckpointError, ConfigError):
    """The checkpoint was made with another configuration (a fingerprinted flag, the model's shapes, sharded
    optimizer state at another world size): a configuration mistake, so the run ends as ``config``."""


class UsageError(ElasticDDPError):
    """The runtime was called out of order (a save before the restore), or a step broke the contract of the
    loop around it (a step whose data position did not move: a forgotten ``sampler.commit``)."""
