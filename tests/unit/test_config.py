"""Configuration: CLI generated from the dataclasses, layered files, validation naming flags."""

from __future__ import annotations

import dataclasses
import json

import pytest

from elastic_ddp.config import (
    OptimConfig,
    TrainConfig,
    build_parser,
    config_from_args,
    fingerprint,
    fingerprint_mismatches,
    make_config,
    not_fingerprinted,
)
from elastic_ddp.errors import ConfigError


def test_every_field_is_a_flag_with_help_text() -> None:
    parser = build_parser()
    actions = {action.dest: action for action in parser._actions}
    config = TrainConfig()
    leaves = [f.name for f in dataclasses.fields(config) if not dataclasses.is_dataclass(getattr(config, f.name))]
    sections = [f.name for f in dataclasses.fields(config) if dataclasses.is_dataclass(getattr(config, f.name))]
    dests = leaves + [f"{s}.{f.name}" for s in sections for f in dataclasses.fields(getattr(config, s))]
    assert len(dests) >= 20
    for dest in dests:
        assert dest in actions, dest
        assert actions[dest].help and len(actions[dest].help) > 20, dest


def test_documented_flag_names_exist() -> None:
    config = config_from_args(
        ["--max-steps", "7", "--checkpoint-dir", "s3://b/x", "--checkpoint-every", "3", "--seed", "9",
         "--global-batch-size", "16"]
    )
    assert (config.max_steps, config.checkpoint.dir, config.checkpoint.every, config.seed, config.global_batch_size) == (
        7, "s3://b/x", 3, 9, 16,
    )


def test_flags_override_a_config_file_which_overrides_defaults(tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('seed = 4\nmax_steps = 9\n[optim]\nlr = 0.5\n[checkpoint]\nevery = 2\ndir = "/tmp/c"\n')
    config = config_from_args(["--config", str(path), "--max-steps", "11"])
    assert (config.seed, config.max_steps, config.optim.lr, config.checkpoint.every) == (4, 11, 0.5, 2)
    assert config.global_batch_size == TrainConfig().global_batch_size


def test_json_config_file_with_unknown_and_wrong_typed_keys_reports_all(tmp_path, capsys) -> None:
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"max_stepz": 1, "optim": {"lr": "x"}, "global_batch_size": 0}))
    with pytest.raises(SystemExit) as exit_info:
        config_from_args(["--config", str(path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "max_stepz: unknown setting" in err and "--optim-lr:" in err and "--global-batch-size:" in err


def test_all_problems_are_reported_at_once() -> None:
    with pytest.raises(ConfigError) as error:
        make_config({"max_steps": "-1", "optim.lr": "0", "checkpoint.keep": "1", "log.every": "0"})
    message = str(error.value)
    for flag in ("--max-steps", "--optim-lr", "--checkpoint-keep", "--log-every"):
        assert flag in message


def test_a_run_needs_some_end() -> None:
    with pytest.raises(ConfigError, match="never end"):
        make_config({"max_steps": "0", "max_epochs": "0"})


def test_boolean_flags_have_negations() -> None:
    assert config_from_args(["--no-loader-shuffle"]).loader.shuffle is False
    assert config_from_args(["--use-amp"]).use_amp is True


def test_fingerprint_names_changed_fields_and_ignores_resumable_ones() -> None:
    saved = fingerprint(TrainConfig())
    changed = fingerprint(make_config({"global_batch_size": "32", "max_steps": "999", "log.every": "3"}))
    problems = fingerprint_mismatches(saved, changed)
    assert len(problems) == 1 and "--global-batch-size" in problems[0]


# -- a script's own sections -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShapeConfig:
    """A script's model section."""

    width: int = 16
    """Hidden width of the script's model."""
    log_norms: bool = not_fingerprinted(False)
    """Log gradient norms (does not change the model or the data)."""

    def problems(self) -> list[tuple[str, str]]:
        return [("width", "must be >= 1")] if self.width < 1 else []


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScriptConfig(TrainConfig):
    shape: ShapeConfig = dataclasses.field(default_factory=ShapeConfig)
    optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=0.5))
    use_amp: bool = True


def test_a_scripts_section_joins_the_flags_the_file_layering_and_the_help(tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[shape]\nwidth = 5\n")
    config = config_from_args(["--config", str(path), "--shape-log-norms"], config_class=ScriptConfig)
    assert isinstance(config, ScriptConfig) and config.shape == ShapeConfig(width=5, log_norms=True)
    help_text = build_parser(config_class=ScriptConfig).format_help()
    assert "--shape-width" in help_text and "Hidden width of the script's model" in help_text


def test_a_scripts_defaults_replace_the_runtimes() -> None:
    config = config_from_args([], config_class=ScriptConfig)
    assert (config.optim.lr, config.use_amp, config.optim.beta1) == (0.5, True, OptimConfig().beta1)
    assert config_from_args(["--optim-lr", "0.1"], config_class=ScriptConfig).optim.lr == 0.1


def test_a_bad_value_in_a_scripts_section_exits_2_naming_its_flag_with_every_other_problem(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        config_from_args(["--shape-width", "0", "--log-every", "0"], config_class=ScriptConfig)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--shape-width: must be >= 1" in err and "--log-every:" in err


def test_a_scripts_fields_are_fingerprinted_unless_declared_free() -> None:
    saved = fingerprint(config_from_args([], config_class=ScriptConfig))
    assert "shape.width" in saved and "shape.log_norms" not in saved and "optim.lr" not in saved
    changed = fingerprint(config_from_args(["--shape-width", "32", "--shape-log-norms"], config_class=ScriptConfig))
    assert fingerprint_mismatches(saved, changed) == ["--shape-width was 16 in the checkpoint, is 32 now"]


def test_a_config_file_that_is_not_an_object_is_one_error(tmp_path, capsys) -> None:
    path = tmp_path / "run.json"
    path.write_text("[1, 2]")
    with pytest.raises(SystemExit) as exit_info:
        config_from_args(["--config", str(path)])
    assert exit_info.value.code == 2 and "must hold an object of settings" in capsys.readouterr().err
