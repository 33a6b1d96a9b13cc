"""Atomic checkpoints: storage protocol, manifest (the commit), and the save/restore manager."""

from elastic_ddp.checkpoint.manager import CheckpointInfo, CheckpointManager, Restored
from elastic_ddp.checkpoint.manifest import Manifest
from elastic_ddp.checkpoint.storage import FileRecord, Storage, open_storage

__all__ = ["CheckpointInfo", "CheckpointManager", "FileRecord", "Manifest", "Restored", "Storage", "open_storage"]
