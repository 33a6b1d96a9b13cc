"""elastic_ddp: a fault-tolerant elastic training runtime for PyTorch DDP."""

__version__ = "0.1.0"
