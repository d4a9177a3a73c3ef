"""End the RL driver at once when a Ray node of its cluster dies, or an actor of its job crashes, so that the launcher
can restart the run.

After a node is lost, verl 0.9.1's RL trainer does not always fail: a rollout request to a server on the dead node
fails inside the agent loop, which logs the error and goes on, and the trainer then waits for that sample for ever
(seen in the Ray chaos test: no error for 600 s after the node's processes were SIGKILLed; in another draw the same
fault ended the driver in 42 s with ``ActorDiedError``). A rollout server that dies alone, on a node that lives on,
leaves the trainer waiting the same way. A hung driver is never restarted.

:func:`start` (called in the driver by :class:`verl_ds4.recipes.resume_check.RunRecordCallback`, the RL recipes'
checkpoint callback) starts a daemon thread that notes the cluster's alive nodes and checks Ray's node table every
``VERL_DS4_NODE_WATCH_S`` seconds (5 by default; 0 turns it off). When one of them is no longer alive (Ray's GCS
declares a node dead after its health checks fail, about 30-40 s after the node stopped), it prints which node, at
which step, and ends the driver's process with status 1: verl's ``main_ppo`` then fails with the driver's death, and the
launcher's supervisor restarts the run from the newest intact checkpoint once the cluster has its nodes again. The
cluster is the run's own (the launchers start one per job), so every node of it counts. Each look also reads Ray's
actor table (from the GCS, no dashboard needed): an actor of the driver's job whose worker process died unexpectedly
(a crash, a SIGKILL, the OOM killer; not ``ray.kill``, an actor's own exit, or one gone out of scope) ends the driver
the same way, naming the actor.
"""

from __future__ import annotations

import os
import sys
import threading
import time

__all__ = ["ENV", "start"]

ENV = "VERL_DS4_NODE_WATCH_S"
_started = False


def _nodes() -> dict[str, tuple[bool, str]]:
    """Ray's node table: ``{node id: (alive, address)}`` (a dead node stays in it, marked not alive)."""
    import ray

    return {n["NodeID"]: (bool(n.get("Alive")), n.get("NodeManagerAddress", "?")) for n in ray.nodes()}


def _crashed_actors(job: str) -> dict[str, str]:
    """The actors of Ray job ``job`` (hex id) whose worker process died unexpectedly: ``{actor id: description}``.

    Ray's actor table gives the cause: ``WORKER_DIED`` with the worker's exit type ``SYSTEM_ERROR`` (a crash, a
    SIGKILL) or an OOM kill count; ``WORKER_DIED`` with ``INTENDED_USER_EXIT`` (the actor ended itself),
    ``RAY_KILL``, ``OUT_OF_SCOPE``, ``OWNER_DIED`` and ``NODE_DIED`` (the node watch's) do not.
    """
    from ray._private import state  # the GCS's actor table (ray.util.state needs the dashboard, off in many clusters)

    crashed = {}
    for actor_id, info in state.actors().items():
        if info.get("JobID") != job or info.get("State") != "DEAD":
            continue
        cause = info.get("DeathCause")
        if cause is None:
            continue
        died, oom = cause.actor_died_error_context, cause.HasField("oom_context")
        system = died.reason == 1 and "Worker exit type: SYSTEM_ERROR" in died.error_message  # 1: WORKER_DIED
        if system or oom:
            crashed[actor_id] = (f"{died.class_name or info.get('ActorClassName') or 'an actor'} (pid {info.get('Pid')}"
                                 f"{', out of memory' if oom else ''})")
    return crashed


def _watch(nodes: dict[str, str], every: float, step_of, job: str | None = None,
           before: frozenset = frozenset()) -> None:
    import ray

    while True:
        time.sleep(every)
        if not ray.is_initialized():  # the driver shut Ray down: nothing left to watch
            return
        try:
            table = _nodes()
            crashed = {a: d for a, d in _crashed_actors(job).items() if a not in before} if job else {}
        except Exception:  # the GCS briefly unreachable: look again
            continue
        lost = sorted(n for n in nodes if n in table and not table[n][0])
        if lost:
            names = ", ".join(f"{n[:12]} ({nodes[n]})" for n in lost)
            print(f"[verl-ds4] FAILED: Ray node {names} of this run died (Ray's node table says so) during step "
                  f"{step_of()}; ending the driver so that the launcher restarts the run from the newest intact "
                  "checkpoint (verl's trainer may otherwise wait for ever for the lost node's work)",
                  file=sys.stderr, flush=True)
            os._exit(1)
        if crashed:
            print(f"[verl-ds4] FAILED: Ray actor {', '.join(sorted(crashed.values()))} of this run died unexpectedly "
                  f"(Ray's actor table says so) during step {step_of()}; ending the driver so that the launcher "
                  "restarts the run from the newest intact checkpoint (verl's trainer may otherwise wait for ever for "
                  "its work)", file=sys.stderr, flush=True)
            os._exit(1)


def start(step_of=lambda: "?") -> bool:
    """Start the watch in this (the driver's) process, once; False when off or Ray is not initialised."""
    global _started
    every = float(os.environ.get(ENV, "5") or 0)
    if _started or every <= 0:
        return False
    import ray

    if not ray.is_initialized():
        return False
    nodes = {n: address for n, (alive, address) in _nodes().items() if alive}
    job = ray.get_runtime_context().get_job_id()
    before = frozenset(_crashed_actors(job))  # already dead at the start: not this attempt's fault to act on
    threading.Thread(target=_watch, args=(nodes, every, step_of, job, before), name="verl-ds4-node-watch",
                     daemon=True).start()
    _started = True
    return True
