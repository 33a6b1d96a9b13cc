"""Fault triggers and target choice: pure decisions, no processes."""

from __future__ import annotations

import random

from chaos.faults import (
    Observation,
    Previous,
    TriggerState,
    choose_node,
    choose_worker,
    directed_pairs,
    in_flight,
    peer_hosts,
)
from chaos.scenario import Target, Trigger


def test_a_step_trigger_fires_once_the_step_is_reached() -> None:
    state = TriggerState(Trigger(at_step=50))
    assert not state.update(Observation(100.0, 49))
    assert state.update(Observation(100.5, 50))


def test_time_and_step_must_both_hold() -> None:
    state = TriggerState(Trigger(at_s=10.0, at_step=50))
    assert not state.update(Observation(5.0, 80))
    assert not state.update(Observation(12.0, 20))
    assert state.update(Observation(12.0, 50))


def test_a_save_trigger_ignores_unfinished_saves_seen_when_it_armed() -> None:
    state = TriggerState(Trigger(at_step=60, during_save=True))
    assert not state.update(Observation(1.0, 55, unfinished_saves=frozenset({40})))  # not armed yet
    assert not state.update(Observation(1.1, 61, unfinished_saves=frozenset({40})))  # arms; 40 is a leftover
    assert not state.update(Observation(1.2, 70, unfinished_saves=frozenset({40})))
    assert state.update(Observation(1.3, 80, unfinished_saves=frozenset({40, 80})))
    assert state.save_step == 80


def test_a_save_trigger_does_not_fire_on_the_observation_that_arms_it() -> None:
    state = TriggerState(Trigger(during_save=True))
    assert not state.update(Observation(0.0, 0, unfinished_saves=frozenset({20})))
    assert state.update(Observation(0.1, 40, unfinished_saves=frozenset({20, 40})))
    assert state.save_step == 40


def test_a_named_node_is_hit_only_while_it_runs() -> None:
    rng = random.Random(0)
    assert choose_node(Target(form="node", index=1), [0, 1], rng, min_nodes=1).index == 1
    gone = choose_node(Target(form="node", index=1), [0], rng, min_nodes=1)
    assert gone.index is None and gone.reason == "node1 is not running"


def test_a_named_node_may_take_the_job_below_its_minimum() -> None:
    assert choose_node(Target(form="node", index=0), [0], random.Random(0), min_nodes=1).index == 0


def test_random_and_newest_never_take_the_job_below_its_minimum() -> None:
    rng = random.Random(0)
    for form in ("random", "newest"):
        choice = choose_node(Target(form=form), [3], rng, min_nodes=1)
        assert choice.index is None and "only 1 node(s) running" in choice.reason


def test_newest_picks_the_last_started_running_node() -> None:
    assert choose_node(Target(form="newest"), [0, 2, 5], random.Random(0), min_nodes=1).index == 5


def test_random_choices_repeat_with_the_seed() -> None:
    picks = [choose_node(Target(form="random"), [0, 1, 2, 3], random.Random(7), 1).index for _ in range(2)]
    assert picks[0] == picks[1]


def test_a_worker_is_chosen_by_its_global_rank() -> None:
    ranks = {0: 100, 1: 101, 2: 200}
    assert choose_worker(Target(form="rank", index=2), ranks, random.Random(0)).index == 200
    missing = choose_worker(Target(form="rank", index=5), ranks, random.Random(0))
    assert missing.index is None and missing.reason == "no running worker has rank 5"
    assert choose_worker(Target(form="random"), ranks, random.Random(0)).index in ranks.values()
    assert choose_worker(Target(form="random"), {}, random.Random(0)).reason == "no worker is running"


def test_after_s_counts_from_the_previous_fault() -> None:
    state = TriggerState(Trigger(after_s=5.0))
    assert not state.update(Observation(30.0, 10), previous=None)  # the previous one has not fired
    assert not state.update(Observation(30.0, 10), previous=Previous(26.0, 8))
    assert state.update(Observation(31.0, 10), previous=Previous(26.0, 8))


def test_after_steps_waits_for_new_steps_beyond_the_previous_fault() -> None:
    state = TriggerState(Trigger(after_steps=50))
    previous = Previous(10.0, 120)  # the newest step was 120 when the previous fault fired
    assert not state.update(Observation(40.0, 169), previous=previous)  # redone and new steps up to 169
    assert state.update(Observation(41.0, 170), previous=previous)


def test_the_first_fault_counts_from_the_start() -> None:
    assert TriggerState(Trigger(after_s=5.0)).update(Observation(5.0, 0))


def test_a_world_size_trigger_waits_for_that_world_size() -> None:
    state = TriggerState(Trigger(at_step=100, world_size=2))
    assert not state.update(Observation(1.0, 150, world_size=1))
    assert state.update(Observation(2.0, 160, world_size=2))


def test_a_save_in_flight_is_newer_than_every_commit() -> None:
    # 20: retention is removing it; 70: a failed save's leftover below the newest commit; 100: being written
    assert in_flight({20, 70, 100}, {40, 60, 80}) == frozenset({100})
    assert in_flight({20}, set()) == frozenset({20})


HOSTS = ["e0", "s3", "n0", "n1", "n2", "md"]


def test_peers_name_groups_of_fabric_hosts_never_the_target_itself() -> None:
    assert peer_hosts("nodes", "n1", HOSTS) == ["n0", "n2"]
    assert peer_hosts("etcd", "n1", HOSTS) == ["e0"]
    assert peer_hosts("storage", "n1", HOSTS) == ["s3"]
    assert peer_hosts("all", "n1", HOSTS) == ["e0", "s3", "n0", "n2"]  # the metadata server is no peer
    assert peer_hosts("node:2", "n1", HOSTS) == ["n2"]
    assert peer_hosts("node:1", "n1", HOSTS) == []
    assert peer_hosts("node:7", "n1", HOSTS) == []


def test_a_one_way_cut_drops_only_one_direction() -> None:
    assert directed_pairs("n1", ["n0"], "out") == [(["n1"], ["n0"])]
    assert directed_pairs("n1", ["n0"], "in") == [(["n0"], ["n1"])]
    assert directed_pairs("n1", ["n0", "e0"], "both") == [(["n1"], ["n0", "e0"]), (["n0", "e0"], ["n1"])]
