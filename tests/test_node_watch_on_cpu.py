"""The RL driver's node watch (:mod:`verl_ds4.recipes.node_watch`): a node of the cluster that Ray declares dead ends
the driver with the node and the step named; while every node stays alive it does nothing (the control). Ray's node
table is replaced by a scripted one here; the real fault is the two-node Ray chaos test's."""

from __future__ import annotations

import pytest

from verl_ds4.recipes import node_watch


class _Exit(BaseException):  # not an Exception: the watch looks again after those
    pass


def _run_watch(monkeypatch, tables):
    calls = iter(tables)

    def alive():
        try:
            return next(calls)
        except StopIteration:
            raise _Exit("no exit") from None

    def exit_(status):
        raise _Exit(f"exit {status}")

    monkeypatch.setattr(node_watch, "_nodes", alive)
    monkeypatch.setattr("ray.is_initialized", lambda: True)
    monkeypatch.setattr(node_watch.os, "_exit", exit_)
    monkeypatch.setattr(node_watch.time, "sleep", lambda s: None)
    with pytest.raises(_Exit) as ended:
        node_watch._watch({"aaaaaaaaaaaa1111": "10.0.0.1", "bbbbbbbbbbbb2222": "10.0.0.2"}, 5, lambda: 4)
    return str(ended.value)


A, B, C = "aaaaaaaaaaaa1111", "bbbbbbbbbbbb2222", "cccccccccccc3333"
BOTH = {A: (True, "10.0.0.1"), B: (True, "10.0.0.2")}


def test_a_dead_node_ends_the_driver_naming_it_and_the_step(monkeypatch, capsys):
    assert _run_watch(monkeypatch, [BOTH, BOTH, {**BOTH, B: (False, "10.0.0.2")}]) == "exit 1"
    err = capsys.readouterr().err
    assert "[verl-ds4] FAILED: Ray node bbbbbbbbbbbb (10.0.0.2) of this run died" in err and "during step 4" in err


def test_control_nodes_alive_a_replacement_added_or_another_cluster_do_not_end_it(monkeypatch, capsys):
    # another cluster (Ray shut down and started again in the same process): its table lacks the watched nodes
    other = {C: (True, "10.0.0.3")}
    assert _run_watch(monkeypatch, [BOTH, {**BOTH, C: (True, "10.0.0.3")}, other]) == "no exit"
    assert "FAILED" not in capsys.readouterr().err


def test_off_without_ray_or_with_zero(monkeypatch):
    monkeypatch.setenv(node_watch.ENV, "0")
    assert node_watch.start() is False
    monkeypatch.setenv(node_watch.ENV, "5")
    assert node_watch.start() is False  # Ray not initialised in this process
