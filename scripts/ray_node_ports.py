"""Ports for one Ray node that shares its host with others (scripts/ray_cluster.sh, RAY_NODE_PORTS=auto).

    python scripts/ray_node_ports.py COUNT WIDTH [AVOID...]

Prints COUNT distinct TCP ports free on this host now, then the first and last port of a window of WIDTH
ports (the node's workers'; drawn first, the COUNT ports lie outside it) that are all free now and that no
running raylet on this host has as its worker range (read from the raylets' command lines), all drawn at
random from 20000 up to the kernel's ephemeral range, never one of Ray's default ports. AVOID: ports the
node's command line names itself (RAY_PORT, RAY_DASHBOARD_PORT).

Ray's own defaults are left out of every draw (ray 2.60, ``ray start`` in ray/scripts/scripts.py and
ray/_private/ray_constants.py): a node's component whose port is not set explicitly takes its default,
and Ray refuses to start a node where two components share one ("Ray component dashboard_agent_http is
trying to use a port number 10001 that is used by other components") -- or, on a host shared with a
node that runs on Ray's defaults, the port is simply taken.

A port the OS hands out (bind to port 0) can be taken by any process before its owner binds it: seen,
the runtime-env agent's "Address already in use" with workers on OS-assigned ports, and verl's trainer
losing its torch.distributed MASTER_PORT (an OS-assigned port it frees and binds again) to a worker that
bound it in between (EADDRINUSE in init_process_group, verl #5889). Hence ports drawn at random below the
ephemeral range, not port 0.
"""

from __future__ import annotations

import os
import random
import re
import socket
import sys
from collections.abc import Callable, Iterable

# Ports `ray start` gives a component when the command line does not set one.
RAY_DEFAULT_PORTS = {
    6379: "GCS (--port, ray_constants.DEFAULT_PORT)",
    8265: "dashboard (--dashboard-port, ray_constants.DEFAULT_DASHBOARD_PORT)",
    10001: "Ray client server (--ray-client-server-port; set in `ray start` when ray[client] is installed)",
    52365: "dashboard agent http (--dashboard-agent-listen-port, ray_constants.DEFAULT_DASHBOARD_AGENT_LISTEN_PORT)",
}
# The workers' default range (--min-worker-port 10002, --max-worker-port 19999).
RAY_DEFAULT_WORKER_PORTS = range(10002, 20000)
# Draws start above every default (10001 and the default worker range).
LOWEST = 20000


def is_ray_default(port: int) -> bool:
    return port in RAY_DEFAULT_PORTS or port in RAY_DEFAULT_WORKER_PORTS


def ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def raylet_worker_ranges() -> list[tuple[int, int]]:
    """The worker port ranges of the raylets running on this host (from their command lines)."""
    pattern = re.compile(r"--(min|max)_worker_port=(\d+)")
    taken = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        ranges = dict(m.groups() for m in map(pattern.fullmatch, args) if m)
        if "min" in ranges and "max" in ranges and int(ranges["max"]) > 0:
            taken.append((int(ranges["min"]), int(ranges["max"])))
    return taken


def bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def pick(count: int, width: int, avoid: Iterable[int] = (), *, low: int | None = None,
         taken: list[tuple[int, int]] | None = None, free: Callable[[int], bool] = bindable,
         rng: random.Random | None = None) -> list[int]:
    """``count`` service ports, then the first and last port of a worker window of ``width`` ports."""
    avoid = set(avoid)
    low = ephemeral_low() if low is None else low
    taken = raylet_worker_ranges() if taken is None else taken
    rng = rng or random.SystemRandom()
    # Never into the ephemeral range: a port there can be handed to any process's outgoing connection.
    top = min(65536, low)
    most = top - LOWEST - count - 1  # the window's first port is drawn from LOWEST to top - width (exclusive)
    if width > most:
        if most < 1:
            raise RuntimeError(f"RAY_WORKER_PORTS={width}: no worker window fits between {LOWEST} and the ephemeral "
                               f"range (starts at {low}) beside the node's {count} other ports. Fix: move the "
                               "ephemeral range up (sysctl net.ipv4.ip_local_port_range, e.g. '32768 "
                               "60999') or leave RAY_NODE_PORTS empty (Ray's default ports, one node per host)")
        raise RuntimeError(f"RAY_WORKER_PORTS={width}: at most {most} fit between {LOWEST} and the ephemeral range "
                           f"(starts at {low}) beside the node's {count} other ports. Fix: set RAY_WORKER_PORTS={most} "
                           "or lower (200, the default, is enough for most nodes), or move the ephemeral range up "
                           "(sysctl net.ipv4.ip_local_port_range)")

    def usable(port: int) -> bool:
        return port not in avoid and not is_ray_default(port) and not any(a <= port <= b for a, b in taken)

    # The window first: on a crowded host it is the hard part, and services drawn before it could split
    # the only free stretch.
    for _ in range(1000):
        first = rng.randrange(LOWEST, top - width)
        last = first + width - 1
        named = [*avoid, *RAY_DEFAULT_PORTS]
        if any(a <= last and first <= b for a, b in taken) or any(first <= p <= last for p in named):
            continue
        if all(free(p) for p in range(first, last + 1)):
            break
    else:
        raise RuntimeError(f"no window of {width} free worker ports found in {LOWEST}-{top - 1} "
                           f"(RAY_WORKER_PORTS={width}: lower it)")
    picked: list[int] = []
    for _ in range(100000):
        if len(picked) == count:
            break
        port = rng.randrange(LOWEST, top)
        if port not in picked and usable(port) and not first <= port <= last and free(port):
            picked.append(port)
    if len(picked) < count:
        raise RuntimeError(f"no {count} free ports found in {LOWEST}-{top - 1} outside the worker window")
    return picked + [first, last]


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not all(a.isdigit() for a in argv[:2]):
        print("usage: ray_node_ports.py COUNT WIDTH [AVOID...]", file=sys.stderr)
        return 2
    try:
        ports = pick(int(argv[0]), int(argv[1]), (int(p) for p in argv[2:] if p.isdigit()))
    except RuntimeError as err:
        print(err, file=sys.stderr)
        return 1
    print(" ".join(map(str, ports)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
