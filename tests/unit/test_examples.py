"""The examples' own config sections: everything that changes the model or the data is fingerprinted,
and the runtime never names an example's field."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from elastic_ddp.config import config_from_args, fingerprint, fingerprint_mismatches, flag_name

from tests.jobs import REPO, import_example

MLPConfig = import_example("config").MLPConfig
make_datasets = import_example("dataset").make_datasets

RUNTIME_SECTIONS = {"loader", "optim", "checkpoint", "dist", "resilience", "log"}


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
    return str(value // 2 if isinstance(value, int) and value > 2 else value + 1)


def training_data(config: MLPConfig) -> torch.Tensor:
    train, _ = make_datasets(config.data, config.model)
    return torch.cat([train.inputs.flatten(), train.labels.double()])


@pytest.mark.parametrize(("section", "name"), [(s, f.name) for s, f in example_fields(MLPConfig)])
def test_changing_an_example_field_on_resume_is_refused_naming_its_flag_or_keeps_the_data(section, name) -> None:
    flag = flag_name(section, name)
    base = config_from_args([], config_class=MLPConfig)
    other = config_from_args([flag, changed_value(getattr(getattr(base, section), name))], config_class=MLPConfig)
    problems = fingerprint_mismatches(fingerprint(base), fingerprint(other))
    if problems:
        assert len(problems) == 1 and problems[0].startswith(flag + " was ")
    else:
        assert torch.equal(training_data(base), training_data(other)), f"{flag} changes the data but is not fingerprinted"


def test_the_runtime_never_names_an_examples_fields() -> None:
    names = {f.name for _, f in example_fields(MLPConfig)} - {"dropout"}
    flags = {flag_name(section, f.name) for section, f in example_fields(MLPConfig)}
    pattern = re.compile("|".join(re.escape(word) for word in sorted(names | flags)))
    offenders = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in sorted((REPO / "elastic_ddp").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not offenders, "the runtime mentions an example's model or dataset field:\n" + "\n".join(offenders)
