"""The examples' own config sections: everything that changes the model or the data is fingerprinted,
every example takes the common flags, and the runtime never names an example's field."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest
import torch

from elastic_ddp.config import config_from_args, fingerprint, fingerprint_mismatches, flag_name
from tests.jobs import REPO, child_env, import_example, import_script

MLPConfig = import_example("config").MLPConfig
make_datasets = import_example("dataset").make_datasets
lm = import_script(REPO / "examples" / "lm" / "train.py")
byo = import_script(REPO / "examples" / "byo_loop" / "train.py")
texts = import_script(REPO / "examples" / "dict_inputs" / "train.py")

RUNTIME_SECTIONS = {"loader", "optim", "ddp", "checkpoint", "dist", "resilience", "log"}
LM_SMALL = ["--data-budget-bytes", "20000", "--model-context", "16"]  # fast to build; each field means the same


def mlp_training_data(config) -> torch.Tensor:
    train, _ = make_datasets(config.data, config.model)
    return torch.cat([train.inputs.flatten(), train.labels.double()])


def lm_training_data(config) -> torch.Tensor:
    splits = lm.make_splits(config.data.budget_bytes, config.model.context, config.data.val_fraction)
    return torch.stack([splits.train[i][0] for i in range(len(splits.train))])


def text_training_data(config) -> torch.Tensor:
    data = texts.build(config).train_data
    return torch.cat([torch.stack([item["input_ids"] for item in data.items]).flatten(), data.labels])


EXAMPLES = {"mlp": (MLPConfig, mlp_training_data, []), "lm": (lm.LMConfig, lm_training_data, LM_SMALL),
            "dict": (texts.DictConfig, text_training_data, [])}


def example_fields(config_class: type) -> list[tuple[str, dataclasses.Field]]:
    config = config_class()
    return [
        (section.name, f)
        for section in dataclasses.fields(config)
        if dataclasses.is_dataclass(getattr(config, section.name)) and section.name not in RUNTIME_SECTIONS
        for f in dataclasses.fields(getattr(config, section.name))
    ]


def changed_value(value: object) -> str:
    if isinstance(value, bool):
        return "false" if value else "true"
    if isinstance(value, float):
        return repr(value / 2 + 0.25)
    if isinstance(value, str):  # a URI, a directory or a JSON object: "{}" is a valid other value of each
        return "{}" if value != "{}" else "{ }"
    return str(value // 2 if isinstance(value, int) and value > 2 else value + 1)


@pytest.mark.parametrize(
    ("example", "section", "name"), [(e, s, f.name) for e, (cls, _, _) in EXAMPLES.items() for s, f in example_fields(cls)]
)
def test_changing_an_example_field_on_resume_is_refused_naming_its_flag_or_keeps_the_data(example, section, name) -> None:
    config_class, training_data, base_args = EXAMPLES[example]
    flag = flag_name(section, name)
    base = config_from_args(base_args, config_class=config_class)
    other = config_from_args([*base_args, flag, changed_value(getattr(getattr(base, section), name))], config_class=config_class)
    problems = fingerprint_mismatches(fingerprint(base), fingerprint(other))
    if problems:
        assert len(problems) == 1 and problems[0].startswith(flag + " was ")
    else:
        assert torch.equal(training_data(base), training_data(other)), f"{flag} changes the data but is not fingerprinted"


COMMON = ["--max-steps", "7", "--checkpoint-dir", "/tmp/x", "--checkpoint-every", "3"]


def test_every_example_takes_max_steps_checkpoint_dir_and_checkpoint_every() -> None:
    for config_class, _, _ in EXAMPLES.values():
        config = config_from_args(COMMON, config_class=config_class)
        assert (config.max_steps, config.checkpoint.dir, config.checkpoint.every) == (7, "/tmp/x", 3)
    config = byo.parse_args(COMMON)
    assert (config.max_steps, config.checkpoint_dir, config.checkpoint_every) == (7, "/tmp/x", 3)


def test_the_runtime_never_names_an_examples_fields() -> None:
    fields = [(section, f) for cls, _, _ in EXAMPLES.values() for section, f in example_fields(cls)]
    names = {f.name for _, f in fields} - {"dropout", "context"}  # words the runtime may use in their plain sense
    flags = {flag_name(section, f.name) for section, f in fields}
    pattern = re.compile("|".join(re.escape(word) for word in sorted(names | flags)))
    offenders = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in sorted((REPO / "elastic_ddp").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not offenders, "the runtime mentions an example's model or dataset field:\n" + "\n".join(offenders)


def test_the_gpu_check_skips_cleanly_without_a_gpu() -> None:
    """scripts/gpu_check.py, run where no CUDA device is visible, says so and exits 0 before doing anything."""
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py")], cwd=REPO, text=True,
                            capture_output=True, timeout=120, env=child_env({"CUDA_VISIBLE_DEVICES": ""}), check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "gpu_check: skipped: no CUDA device (torch.cuda.is_available() is False)"
