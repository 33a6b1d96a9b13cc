"""The step loop's garbage-collection schedule: cycles are freed at the scheduled steps, not in between."""

from __future__ import annotations

import gc
import weakref

import pytest

from elastic_ddp.collection import StepCollection


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector can free it


def _garbage_cycle() -> weakref.ref:
    return weakref.ref(_Node())


def _allocate_enough_to_trigger_an_automatic_collection() -> None:
    threshold = gc.get_threshold()[0]
    _ = [[] for _ in range(threshold * 20)]


@pytest.fixture
def collection():
    schedule = StepCollection(every=10).start()
    yield schedule
    schedule.stop()


def test_a_cycle_made_in_the_loop_is_freed_at_the_next_scheduled_step_only(collection) -> None:
    cycle = _garbage_cycle()
    _allocate_enough_to_trigger_an_automatic_collection()
    collection.step(9)
    assert cycle() is not None, "collected between scheduled steps"
    collection.step(10)
    assert cycle() is None, "not collected at a scheduled step"


def test_objects_alive_at_start_are_left_out_of_collections_until_stop(collection) -> None:
    assert gc.get_freeze_count() > 0
    assert not gc.isenabled()
    collection.stop()
    assert gc.get_freeze_count() == 0
    assert gc.isenabled()


def test_every_zero_leaves_automatic_collection_on() -> None:
    schedule = StepCollection(every=0).start()
    try:
        assert gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        schedule.stop()
    assert gc.isenabled()


def test_stop_keeps_a_collector_that_was_off_before_start_off() -> None:
    gc.disable()
    try:
        StepCollection(every=5).start().stop()
        assert not gc.isenabled()
    finally:
        gc.enable()
