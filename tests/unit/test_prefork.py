"""Which torchrun command lines run their workers through elastic_ddp.prefork."""

from __future__ import annotations

import os

import pytest
import torch.distributed.run

from elastic_ddp.prefork import torchrun_worker_script

TORCHRUN = "/opt/venv/bin/torchrun"
RUN_PY = torch.distributed.run.__file__  # python -m torch.distributed.run


@pytest.mark.parametrize("program", [TORCHRUN, RUN_PY], ids=["torchrun", "python-m"])
def test_the_script_after_the_prefork_module_is_the_workers(program: str) -> None:
    argv = [program, "--nnodes=1:2", "--rdzv-backend", "etcd-v3", "-m", "elastic_ddp.prefork", "train.py", "--lr", "1"]
    assert torchrun_worker_script(argv) == "train.py"


@pytest.mark.parametrize("argv", [
    [TORCHRUN, "--nnodes=2", "train.py", "-m", "elastic_ddp.prefork"],  # the script's own arguments
    [TORCHRUN, "--nnodes=2", "-m", "mypackage.train"],
    [TORCHRUN, "--nnodes=2", "--no-python", "-m", "elastic_ddp.prefork", "train.py"],
    [TORCHRUN, "--nnodes=2", "-m", "elastic_ddp.prefork"],  # no script: the launcher says so
    [TORCHRUN, "--no-such-option"],
    ["/usr/bin/pytest", "-m", "elastic_ddp.prefork", "x.py"],
    [os.path.join(os.path.dirname(RUN_PY), "launch.py"), "-m", "elastic_ddp.prefork", "x.py"],
    [],
], ids=["script-args", "other-module", "no-python", "no-script", "bad-option", "not-torchrun", "other-torch-file", "empty"])
def test_other_command_lines_name_no_script(argv: list[str]) -> None:
    assert torchrun_worker_script(argv) is None
