"""A multi-node run's checkpoint folder must be one folder that every node sees: checked at start-up.

verl-ds4 supports checkpoint folders on a file system that every node of the run mounts (NFS, Lustre, GPFS, a
cloud file store), and refuses a node-local one (a node's own disk at the same path) before anything is built.
Every rank writes its own shards of a checkpoint into the folder, and the intactness check (the manifest that rank 0
writes after the save, the start-up check of a resume) reads all of them there: on node-local disks each node
would hold a part, the manifest would list node 0's part only, and a resume on other nodes would find nothing.

The check (:func:`probe`), on every node of the run at once: each node writes a marker file named after its node
rank into ``<folder>/.verl_ds4_nodes/<token>/`` and waits until it sees the markers of all the run's nodes (the
token is the same on every node of one start: Slurm's job, requeue count and step, or the rendezvous address). A
node that sees them all within the time allowed has a shared folder; one that does not refuses the run (exit 2),
naming the folder, the nodes it saw and the nodes it did not. Node 0 removes the markers once every node has
seen them all. With Ray (:func:`probe_ray`), the driver places one such task on each node of the cluster.

    python -m verl_ds4.recipes.shared_folder --dir DIR --nodes N --node-rank R [--token T] [--timeout S]
    python -m verl_ds4.recipes.shared_folder --dir DIR --ray [--nodes N] [--timeout S]

A single-node run (``--nodes 1``) passes at once. The launchers' knobs, read here: ``SHARED_CKPT_CHECK=0`` skips the
check (said on the console: for a folder you know every node sees, or a one-machine rehearsal of a multi-node
launch), ``SHARED_CKPT_TIMEOUT`` the seconds to wait (default 120).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import time
from pathlib import Path

__all__ = ["SharedFolderError", "probe", "probe_ray", "run_token"]

PROBE_DIR = ".verl_ds4_nodes"
TIMEOUT_S = 120.0  # every node of a start reaches the check within seconds of the others; generous under load
POLL_S = 0.2


class SharedFolderError(Exception):
    """The checkpoint folder is not one folder that every node of the run sees (the message says what to do)."""


def run_token(env: dict | None = None) -> str | None:
    """The same string on every node of one start of a multi-node run, another on the next start (None: unknown).

    Slurm: the job, its requeue count and the step (each restart runs a new ``srun`` step); torchrun started by
    hand on each node: the rendezvous address and the restart count the supervisor sets.
    """
    env = os.environ if env is None else env
    if env.get("SLURM_JOB_ID") and env.get("SLURM_STEP_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}-{env.get('SLURM_RESTART_COUNT', '0')}-{env['SLURM_STEP_ID']}"
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return f"rdzv-{env['MASTER_ADDR']}-{env['MASTER_PORT']}-{env.get('DS4_RESTART', '0')}"
    return None


def probe(folder: str | Path, nodes: int, node_rank: int, token: str, *, timeout: float = TIMEOUT_S,
          names: list[str] | None = None) -> str:
    """One node's part of the check (every node of the run calls it with the same ``token``); returns a fact line.

    ``names``: the nodes' marker names (default ``node0`` .. ``node<N-1>``; Ray passes its node ids).
    """
    folder = Path(str(folder)).expanduser().absolute()
    names = names or [f"node{i}" for i in range(nodes)]
    me = names[node_rank]
    if len(names) <= 1:
        return f"{folder} (one node)"
    where = folder / PROBE_DIR / token
    where.mkdir(parents=True, exist_ok=True)
    mine = where / f"arrived.{me}"
    mine.write_text(f"{socket.gethostname()} {os.getpid()} {time.time():.3f}\n")
    since = mine.stat().st_mtime - timeout  # older markers (a start killed inside its check) are not this start's
    start = time.monotonic()

    def seen(kind: str) -> set[str]:
        found = set()
        try:
            for p in where.iterdir():
                if p.name.startswith(kind + "."):
                    try:
                        if p.stat().st_mtime >= since:
                            found.add(p.name.split(".", 1)[1])
                    except FileNotFoundError:
                        pass
        except FileNotFoundError:
            pass
        return found

    while not set(names) <= seen("arrived"):
        if time.monotonic() - start > timeout:
            got, waited = seen("arrived") & set(names), time.monotonic() - start
            raise SharedFolderError(
                f"verl-ds4: the checkpoint folder {folder} is not shared by the run's {len(names)} nodes: node "
                f"{node_rank} ({socket.gethostname()}) waited {waited:.0f} s for every node's marker in "
                f"{folder / PROBE_DIR} and saw those of node(s) {', '.join(sorted(got)) or 'none'}, not of node(s) "
                f"{', '.join(n for n in names if n not in got)}. Every rank writes its part of a checkpoint there and "
                "the manifest and the resume read all parts, so verl-ds4 supports a folder on a file system that every "
                "node mounts (NFS, Lustre, GPFS, a cloud file store), not a node's own disk: point CKPT_DIR (WORK_DIR "
                f"for the CPU jobs) at a shared path. (If the nodes started more than {waited:.0f} s apart, check that "
                "every node ran this start.)")
        time.sleep(POLL_S)
    (where / f"saw.{me}").write_text("all\n")
    if node_rank == 0:  # the markers go once every node has seen them all (each wrote saw.* after that)
        while not set(names) <= seen("saw") and time.monotonic() - start < timeout:
            time.sleep(POLL_S)
        shutil.rmtree(where, ignore_errors=True)
        try:
            (folder / PROBE_DIR).rmdir()
        except OSError:
            pass  # another run's probe is under way there, or it was already removed
    return f"{folder} (shared: every one of the {len(names)} nodes saw every node's marker)"


def probe_ray(folder: str | Path, *, nodes: int | None = None, timeout: float = TIMEOUT_S) -> str:
    """The check on a running Ray cluster: one task on each node that answers (pinned to it), all with one token.

    ``nodes``: how many nodes the trainer spreads over (at least that many must answer within ``timeout``).
    A node counts once a task pinned to it has run (:func:`_answering`): Ray's table still lists a node that died
    moments ago as alive (until its health check gives up, about 15 s), and a start right after a lost node (a
    restart) must neither pin its check there nor count it.
    """
    import uuid

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # the cluster of RAY_ADDRESS (a Ray job's driver has it), else the one running on this node; never a new one
    ray.init(address=None if os.environ.get("RAY_ADDRESS") else "auto", logging_level="ERROR", log_to_driver=False)
    deadline, told, most = time.monotonic() + timeout, set(), 0
    try:
        while True:
            answered, lost = _answering(ray, NodeAffinitySchedulingStrategy, deadline)
            most = max(most, len(answered))  # a round cut short by the deadline answers fewer
            for node, why in lost.items():
                if node not in told:
                    told.add(node)
                    print(f"[verl-ds4] Ray node {node[:12]} is listed alive but runs no task ({why}): left out of "
                          "the check (a node lost moments ago)", flush=True)
            if nodes is not None and len(answered) < nodes:
                if time.monotonic() < deadline:
                    time.sleep(1.0)
                    continue
                raise SharedFolderError(
                    f"verl-ds4: {most} node(s) of the Ray cluster answered within {timeout:.0f} s, the run "
                    f"needs {nodes}: start the missing ones (scripts/ray_cluster.sh start-worker, then wait-nodes), "
                    "lower NNODES, or give a node that restarts slowly more time (SHARED_CKPT_TIMEOUT)")
            if len(answered) <= 1:
                return f"{Path(str(folder)).expanduser().absolute()} (one node)"
            names = [n[:12] for n in answered]
            token = f"ray-{uuid.uuid4().hex[:12]}"
            task = ray.remote(num_cpus=0, max_retries=0)(_ray_node_probe)
            refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n, soft=False))
                    .remote(str(folder), len(names), i, token, timeout, names) for i, n in enumerate(answered)]
            try:
                results = ray.get(refs)
                break
            except ray.exceptions.RayTaskError:
                raise  # the check itself failed on a node: not a lost node
            except ray.exceptions.RayError as e:  # a node lost during the check: check the nodes that answer again
                if time.monotonic() >= deadline:
                    raise
                print(f"[verl-ds4] a node was lost during the check ({type(e).__name__}): checking again", flush=True)
    finally:
        ray.shutdown()
    refused = [r for r in results if r.startswith("REFUSED ")]
    if refused:
        raise SharedFolderError(refused[0].removeprefix("REFUSED "))  # error-catalogue: a node's refusal, raised in probe
    return results[0]


def _answering(ray, strategy, deadline: float) -> tuple[list[str], dict[str, str]]:
    """The nodes Ray lists alive that ran a task pinned to them by ``deadline``, and why each lost one did not
    (a node whose task has not ended by ``deadline`` is in neither).

    A task pinned to a node that has died waits until Ray marks the node dead, then fails
    (``TaskUnschedulableError``): so once every ping has ended, a dead node is no longer listed alive either.
    """
    alive = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
    ping = ray.remote(num_cpus=0, max_retries=0)(_node_ping)
    refs = {ping.options(scheduling_strategy=strategy(node_id=n, soft=False)).remote(): n for n in alive}
    if not refs:
        return [], {}
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=max(0.0, deadline - time.monotonic()))
    answered, lost = [], {}
    for ref in ready:
        try:
            ray.get(ref)
            answered.append(refs[ref])
        except ray.exceptions.RayError as e:
            lost[refs[ref]] = type(e).__name__
    for ref in pending:
        try:
            ray.cancel(ref, force=True)
        except Exception:  # noqa: BLE001 - a task that cannot be cancelled is left to Ray
            pass
    return sorted(answered), lost


def _node_ping() -> str:
    return socket.gethostname()


def _ray_node_probe(folder: str, nodes: int, rank: int, token: str, timeout: float, names: list[str]) -> str:
    try:
        return probe(folder, nodes, rank, token, timeout=timeout, names=names)
    except SharedFolderError as e:
        return f"REFUSED {e}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Check at start-up that a multi-node run's checkpoint folder is one folder every node sees "
                    "(run on every node at once, or once with --ray); exit 2 with the reason when it is not.")
    parser.add_argument("--dir", required=True, help="the run's checkpoint folder")
    parser.add_argument("--nodes", type=int, default=None, help="the run's nodes (NNODES)")
    parser.add_argument("--node-rank", type=int, default=None, help="this node's rank (NODE_RANK)")
    parser.add_argument("--token", help="the same string on every node of this start (default: from Slurm's or "
                                        "torchrun's environment)")
    parser.add_argument("--ray", action="store_true", help="check every node of the running Ray cluster from here")
    parser.add_argument("--timeout", type=float, default=None,
                        help=f"seconds to wait (default: SHARED_CKPT_TIMEOUT, else {TIMEOUT_S:.0f})")
    args = parser.parse_args(argv)
    check = os.environ.get("SHARED_CKPT_CHECK", "1")
    if check not in ("0", "1"):
        print(f"SHARED_CKPT_CHECK={check}: expected 1 (check that every node sees the checkpoint folder, the default) "
              "or 0 (skip the check)", file=sys.stderr)
        return 2
    if check == "0":
        print(f"[verl-ds4] checkpoint folder {args.dir}: not checked for being shared by every node "
              "(SHARED_CKPT_CHECK=0)", flush=True)
        return 0
    if args.timeout is None:
        try:
            args.timeout = float(os.environ.get("SHARED_CKPT_TIMEOUT", TIMEOUT_S))
        except ValueError:
            args.timeout = -1.0
        if not args.timeout > 0:
            print(f"SHARED_CKPT_TIMEOUT={os.environ.get('SHARED_CKPT_TIMEOUT')}: expected a positive number of "
                  f"seconds (default {TIMEOUT_S:.0f})", file=sys.stderr)
            return 2
    try:
        if args.ray:
            fact = probe_ray(args.dir, nodes=args.nodes, timeout=args.timeout)
        else:
            if args.nodes is None or args.node_rank is None or not 0 <= args.node_rank < args.nodes:
                parser.error("give --nodes N and --node-rank R (0 <= R < N), or --ray")
            token = args.token or run_token()
            if args.nodes > 1 and token is None:
                parser.error("no Slurm step or rendezvous address (MASTER_ADDR, MASTER_PORT) to name this start: "
                             "give --token, the same on every node")
            fact = probe(args.dir, args.nodes, args.node_rank, token or "", timeout=args.timeout)
    except SharedFolderError as e:
        print(str(e), file=sys.stderr)  # error-catalogue: passes on a message catalogued where it is built
        return 2
    print(f"[verl-ds4] checkpoint folder {fact}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
