"""The library path: the runtime for a training loop you keep (docs/design.md, "Bring your own model").

Two pieces turn a hand-written DDP loop into an elastic one (``examples/byo_loop/train.py`` shows them
in the seed pipeline's own loop):

* :class:`~elastic_ddp.data.ElasticSampler` — the global cursor. Use it as the DataLoader's
  ``batch_sampler``; each step ``plan()`` says which samples form it (the same at any world size),
  ``local_micro_batches(plan)`` which of them are this rank's, ``loss_scale(plan)`` how to weight this
  rank's *summed* per-sample loss so DDP's gradient is the global-batch mean, and ``commit(plan)``
  records the step.
* :class:`~elastic_ddp.runtime.Runtime` — the same runtime the trainer steps on, built with
  :meth:`Runtime.for_loop <elastic_ddp.runtime.Runtime.for_loop>`: atomic checkpoints of your model,
  optimizer, scheduler, scaler, the sampler and other ``Stateful`` objects to local disk or S3;
  node-memory replicas and the rescue of a survivor's live state; stop requests and spot notices
  agreed by every rank at the same step; the hang watchdog; the exit status torchrun's agent needs::

      with Runtime.for_loop(model=model, optimizer=optimizer, sampler=sampler, events=events,
                            checkpoint=CheckpointConfig(dir="/ckpt", every=20)) as runtime:
          step = runtime.restore()
          while step < max_steps:
              ...                                     # forward, backward, optimizer.step()
              sampler.commit(plan)
              step += 1
              if runtime.after_step(step).stop:
                  break
      sys.exit(runtime.exit_status)

Run the script under ``torchrun`` (any rendezvous backend, ``etcd-v3`` included); :func:`init_process_group`
forms its process group the way the trainer path does. Give the runtime an
:func:`open_events` log to have the run's events in ``<log_dir>/events.jsonl``. Decorate ``main`` with
:func:`entrypoint`: a mistake the runtime refuses before the ``with`` block (a global batch smaller than
the world, a fingerprint that is not JSON, an object without ``load_state_dict``) then ends in one line
and its status, as the ones inside it do.
"""

from __future__ import annotations

import torch.distributed as dist

from elastic_ddp.config import CheckpointConfig, DistConfig, ResilienceConfig
from elastic_ddp.data import ElasticSampler
from elastic_ddp.distributed import DistContext, LaunchEnv, init_distributed, shutdown_distributed
from elastic_ddp.events import EventLog
from elastic_ddp.membership import in_process_launch
from elastic_ddp.metrics import MetricsWriter
from elastic_ddp.resilience.agreement import Decision
from elastic_ddp.runtime import Runtime, entrypoint
from elastic_ddp.state import model_digest

__all__ = ["CheckpointConfig", "Decision", "DistConfig", "DistContext", "ElasticSampler", "EventLog", "MetricsWriter",
           "ResilienceConfig", "Runtime", "entrypoint", "init_process_group", "model_digest", "open_events",
           "shutdown_process_group"]


def init_process_group(config: DistConfig | None = None) -> DistContext:
    """Form the default process group from torchrun's environment: NCCL and ``cuda:LOCAL_RANK`` when CUDA is
    available, else gloo on the CPU (``config`` may choose), rank 0's fresh store awaited rather than polled
    (a restart's workers meet at once), and a failure to form it within ``config.init_timeout_s`` one error
    naming the rank, the store and the timeout. Returns the rank, world size, device and backend.

    Under the etcd-v3 handler's in-process mode (``--rdzv-conf in_process=true``) it joins the workers'
    membership instead, and ``context.membership`` is it: pass it to ``Runtime.for_loop(membership=...)``."""
    if in_process_launch():
        from elastic_ddp.inprocess import init_in_process  # the etcd client, only when asked for

        return init_in_process(config or DistConfig())
    return init_distributed(config or DistConfig())


def shutdown_process_group() -> None:
    """Destroy the default process group if there is one; safe on every exit path."""
    shutdown_distributed()


def open_events(log_dir: str) -> EventLog:
    """This rank's writer of ``<log_dir>/events.jsonl`` (after the process group is formed; "" writes nothing).
    Pass it to the runtime; close it at the end."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return EventLog(log_dir, run_id=LaunchEnv.from_env().run_id, rank=rank)
