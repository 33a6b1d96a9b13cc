"""Failure handling inside the workers: stop requests (SIGTERM, spot notices), the hang watchdog,
cross-rank consistency checks, and the exit codes that tell torchrun's agent what happened."""
