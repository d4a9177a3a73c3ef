"""Wait until a Ray cluster has at least N alive nodes (used by scripts/ray_cluster.sh wait-nodes).

    python scripts/ray_wait_nodes.py --nodes 4 --timeout 600 [--address 10.0.0.1:6379]

Connects to the running cluster (--address, default "auto": RAY_ADDRESS or the cluster this node
runs), exits 0 once enough nodes are alive, and exits 1 with a message naming the shortfall when
the timeout passes.
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
    while True:
        nodes = [node for node in ray.nodes() if node["Alive"]]
        alive = len(nodes)
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
