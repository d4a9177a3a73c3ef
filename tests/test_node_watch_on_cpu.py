"""The RL driver's node watch (:mod:`verl_ds4.recipes.node_watch`): a node of the cluster that Ray declares dead, or an
actor of the job that crashed, ends the driver with the node or actor and the step named; while every node stays alive
and no new actor crashed it does nothing (the controls). Ray's tables are scripted for the watch's loop; which dead
actors count is read from real Ray (a local instance: a SIGKILLed actor counts, ``ray.kill`` and an actor's own exit do
not); the real node fault is the two-node Ray chaos test's."""

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


def _run_actor_watch(monkeypatch, crashed_seq, before=frozenset()):
    calls = iter(crashed_seq)

    def crashed(job):
        assert job == "01000000"
        try:
            return next(calls)
        except StopIteration:
            raise _Exit("no exit") from None

    monkeypatch.setattr(node_watch, "_crashed_actors", crashed)
    monkeypatch.setattr(node_watch, "_nodes", lambda: BOTH)
    monkeypatch.setattr("ray.is_initialized", lambda: True)
    monkeypatch.setattr(node_watch.os, "_exit", lambda status: (_ for _ in ()).throw(_Exit(f"exit {status}")))
    monkeypatch.setattr(node_watch.time, "sleep", lambda s: None)
    with pytest.raises(_Exit) as ended:
        node_watch._watch({A: "10.0.0.1", B: "10.0.0.2"}, 5, lambda: 7, "01000000", before)
    return str(ended.value)


def test_a_crashed_actor_of_the_job_ends_the_driver_naming_it(monkeypatch, capsys):
    server = {"f00d": "CPURolloutServer (pid 4242)"}
    assert _run_actor_watch(monkeypatch, [{}, server]) == "exit 1"
    err = capsys.readouterr().err
    assert "[verl-ds4] FAILED: Ray actor CPURolloutServer (pid 4242) of this run died unexpectedly" in err
    assert "during step 7" in err


def test_control_an_actor_that_had_crashed_before_the_watch_started_does_not_end_it(monkeypatch, capsys):
    old = {"dead0": "WorkerDict (pid 1)"}  # an earlier attempt's, already dead when this attempt began
    assert _run_actor_watch(monkeypatch, [old, old], before=frozenset(old)) == "no exit"
    assert "FAILED" not in capsys.readouterr().err


_ACTORS = r"""
import json, os, signal, sys, time
import ray
from verl_ds4.recipes import node_watch
ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)

@ray.remote(num_cpus=0)
class Server:
    def pid(self):
        return os.getpid()
    def leave(self):
        ray.actor.exit_actor()

killed, stopped, leaving, alive = (Server.remote() for _ in range(4))
pids = ray.get([a.pid.remote() for a in (killed, stopped, leaving, alive)])
os.kill(pids[0], signal.SIGKILL)  # a crash: the worker process gone
ray.kill(stopped)                 # on purpose
try:
    ray.get(leaving.leave.remote())  # the actor ends itself
except ray.exceptions.RayActorError:
    pass
job = ray.get_runtime_context().get_job_id()
deadline = time.monotonic() + 60
while not (crashed := node_watch._crashed_actors(job)) and time.monotonic() < deadline:
    time.sleep(0.5)
time.sleep(1)  # the other two are dead in the table by now as well
states = {a["Pid"]: a["State"] for a in ray._private.state.actors().values()}
print("RESULT " + json.dumps({"pids": pids, "crashed": node_watch._crashed_actors(job), "states": states,
                              "other_job": node_watch._crashed_actors("ff000000")}))
"""


def test_ray_s_actor_table_names_a_sigkilled_actor_not_one_killed_or_ended_on_purpose():
    """Real Ray (a local instance in a subprocess): which dead actors count as crashed."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", _ACTORS], capture_output=True, text=True, timeout=300, cwd=repo)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    killed, stopped, leaving, alive = result["pids"]
    states = {int(pid): state for pid, state in result["states"].items()}
    # the controls: the ones ended on purpose are dead too, the fourth is alive
    assert states[stopped] == states[leaving] == states[killed] == "DEAD" and states[alive] == "ALIVE", states
    assert list(result["crashed"].values()) == [f"Server (pid {killed})"], result["crashed"]
    assert result["other_job"] == {}
