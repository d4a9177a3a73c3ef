"""Wait until a Ray cluster has at least N alive nodes (used by scripts/ray_cluster.sh wait-nodes).

    python scripts/ray_wait_nodes.py --nodes 4 --timeout 600 [--address 10.0.0.1:6379] [--quiet]

Connects to the running cluster (--address, default "auto": RAY_ADDRESS or the cluster this node
runs), exits 0 once enough nodes are alive, and exits 1 with a message naming the shortfall when
the timeout passes. --quiet (the RL launchers, before each start of a run on a cluster: a restart
after a node was lost waits here for its replacement): no output when the nodes are there at once,
else a line saying what it waits for.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, required=True, help="number of alive nodes to wait for")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait (default 600)")
    parser.add_argument("--poll", type=float, default=1.0, help="seconds between checks (default 1)")
    parser.add_argument("--address", default="auto", help="Ray GCS address host:port (default auto)")
    parser.add_argument("--quiet", action="store_true", help="say nothing when the nodes are alive at the first look")
    args = parser.parse_args(argv)
    if args.nodes < 1:
        parser.error(f"--nodes must be >= 1, got {args.nodes}")

    import ray

    where = args.address if args.address != "auto" else "the cluster of this node (address auto)"
    try:
        ray.init(address=args.address, logging_level="ERROR")
    except Exception as err:  # ConnectionError, or Ray's own for a GCS that does not answer
        print(f"ray cluster: no Ray cluster answers at {where}: {type(err).__name__}: {err}; "
              "start the head first (scripts/ray_cluster.sh start-head) and check RAY_HEAD_IP / RAY_PORT",
              file=sys.stderr)
        return 1
    deadline = time.monotonic() + args.timeout
    first = True
    while True:
        nodes = [node for node in ray.nodes() if node["Alive"]]
        alive = len(nodes)
        if alive >= args.nodes and first and args.quiet:
            return 0
        if alive < args.nodes and first and args.quiet:
            print(f"[verl-ds4] waiting up to {args.timeout:.0f}s for {args.nodes} Ray nodes ({alive} alive at {where}): "
                  "a lost node must be started again (scripts/ray_cluster.sh start-worker on it, or the cluster "
                  "manager's replacement)", flush=True)
        first = False
        if alive >= args.nodes:
            ids = ", ".join(f"{n.get('NodeID', '?')[:12]} ({n.get('NodeManagerAddress', '?')})" for n in nodes)
            print(f"ray cluster: {alive} of {args.nodes} nodes alive at {where}: {ids}")
            return 0
        if time.monotonic() > deadline:
            print(
                f"ray cluster: only {alive} of {args.nodes} nodes alive at {where} after {args.timeout:.0f}s; "
                "check that every worker ran `scripts/ray_cluster.sh start-worker` with the right RAY_HEAD_IP",
                file=sys.stderr,
            )
            return 1
        time.sleep(args.poll)


if __name__ == "__main__":
    sys.exit(main())
