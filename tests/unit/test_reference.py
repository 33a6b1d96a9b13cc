"""docs/reference.md is what the code says: every flag with its default and help, every event kind, every exit."""

from __future__ import annotations

from elastic_ddp.config import TrainConfig, build_parser
from elastic_ddp.events import FIELDS, WRITTEN, Event
from elastic_ddp.reference import reference
from tests.jobs import REPO


def test_the_reference_document_is_the_generated_one() -> None:
    written = (REPO / "docs" / "reference.md").read_text(encoding="utf-8")
    assert written == reference(), "docs/reference.md is stale: python -m elastic_ddp.reference > docs/reference.md"


def test_every_flag_and_event_kind_is_in_it() -> None:
    text = reference()
    flags = [option for action in build_parser(config_class=TrainConfig)._actions for option in action.option_strings
             if option.startswith("--") and option not in ("--help", "--config") and not option.startswith("--no-")]
    assert flags and [flag for flag in flags if f"`{flag}`" not in text] == []
    assert set(WRITTEN) == set(Event) == set(FIELDS)
    for kind, (_, fields) in WRITTEN.items():
        assert f"`{kind.value}`" in text
        assert [field for field in FIELDS[kind] if f"`{field}`" not in fields] == [], kind
