"""``elastic-ddp launch``: a local elastic job of simulated nodes, part of the runtime.

- :mod:`elastic_ddp.launcher.command`: the command (arguments, the work directory, the run);
- :mod:`elastic_ddp.launcher.nodes`: the nodes, each a torchrun agent with its workers;
- :mod:`elastic_ddp.launcher.etcd`: the embedded etcd (and the etcd processes tests and chaos start);
- :mod:`elastic_ddp.launcher.console`: what the launcher prints (progress, restarts, the end);
- :mod:`elastic_ddp.lifeline`: every process it starts dies with it.

The chaos harness (``python -m chaos``) builds on this package; nothing here imports chaos or torch.
"""

from __future__ import annotations

from elastic_ddp.launcher.command import LaunchError, add_arguments, launch, main, node_range

__all__ = ["LaunchError", "add_arguments", "launch", "main", "node_range"]
