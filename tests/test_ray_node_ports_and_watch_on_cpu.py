"""RAY_NODE_PORTS=auto (scripts/ray_cluster.sh, scripts/ray_node_ports.py) never hands a Ray node one of Ray's
default ports, and leaves no component of a node to its default.

A CI run once hung ten minutes: the worker node's ``ray start`` refused "Ray component dashboard_agent_http is
trying to use a port number 10001 that is used by other components" (10001 is the Ray client server's default,
which the worker did not set, and the draw gave it to the dashboard agent). No Ray node starts here: the port
draws run on their own, and the list of defaults is checked against the installed Ray's ``ray start``.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("ray_node_ports", REPO / "scripts" / "ray_node_ports.py")
ports_mod = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(ports_mod)

SERVICES = 7  # node manager, object manager, dashboard agent http + grpc, runtime-env agent, metrics, client server


def _ray_start_defaults() -> dict[str, object]:
    """Every port option of the installed ``ray start`` -> the port it takes when not given."""
    pytest.importorskip("ray")
    from ray._private import ray_constants
    from ray.scripts.scripts import start

    defaults = {p.name: p.default for p in start.params if "port" in p.name and p.name != "port_forward"}
    # `ray start` fills two of them in its body rather than in the option: read both from the source.
    body = inspect.getsource(start.callback)
    client = re.search(r"ray_client_server_port is None:\s*\n\s*ray_client_server_port = (\d+)", body)
    assert client, "ray start no longer defaults the Ray client server's port in its body: update this test"
    defaults["ray_client_server_port"] = int(client.group(1))
    assert "port = ray_constants.DEFAULT_PORT" in body
    defaults["port"] = ray_constants.DEFAULT_PORT
    return defaults


def _dry_run_ports(role: str) -> set[str]:
    """The port options ray_cluster.sh passes to ``ray start`` on this node (RAY_NODE_PORTS=auto, dry run)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(PYTHON=sys.executable, RAY_NODE_PORTS="auto", RAY_HEAD_IP="10.0.0.1")
    out = subprocess.run(["bash", "scripts/ray_cluster.sh", "--dry-run", role], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    [line] = [ln for ln in out.stdout.splitlines() if ln.startswith("+ ray start")]
    return {w[2:].split("=", 1)[0].replace("-", "_") for w in shlex.split(line[2:]) if w.startswith("--")}


def test_the_excluded_ports_cover_every_default_of_the_installed_ray_start():
    defaults = _ray_start_defaults()
    fixed = {name: port for name, port in defaults.items() if isinstance(port, int) and port > 0}
    print({name: port for name, port in sorted(fixed.items())})
    # What ray 2.60 has (if Ray adds a port, this names it).
    assert set(fixed) >= {"port", "dashboard_port", "dashboard_agent_listen_port", "ray_client_server_port",
                          "min_worker_port", "max_worker_port"}, fixed
    for name, port in fixed.items():
        assert ports_mod.is_ray_default(port), f"ray start --{name} defaults to {port}, which the draw may hand out"
    worker_range = range(fixed["min_worker_port"], fixed["max_worker_port"] + 1)
    assert all(ports_mod.is_ray_default(p) for p in worker_range)
    assert ports_mod.LOWEST > max(p for p in fixed.values() if p < 50000)
    # Negative control: a port next to them is not excluded.
    assert not ports_mod.is_ray_default(20000) and not ports_mod.is_ray_default(6380)


def _uncontrolled(role: str, given: set[str], excluded=ports_mod.is_ray_default) -> list[str]:
    """The ``ray start`` port options a node leaves to a port the draw may also hand out (or to Ray's choice)."""
    # Head only: the GCS (--port) is the head's; a worker joins with --address. Strings: the redis shards
    # (head with external Redis) and an explicit worker port list (instead of --min/--max-worker-port).
    not_for = {"start-worker": {"port"}, "start-head": set()}[role] | {"redis_shard_ports", "worker_port_list"}
    return [f"--{name.replace('_', '-')} (default {default!r})" for name, default in _ray_start_defaults().items()
            if name not in given and name not in not_for
            and not (isinstance(default, int) and default > 0 and excluded(default))]


@pytest.mark.parametrize("role", ["start-head", "start-worker"])
def test_every_component_port_is_set_or_its_default_excluded(role):
    """Each ``ray start`` port option is either on the node's command line or takes a default the draw never
    gives out; options left to Ray's random choice (None / 0) must be set."""
    given = _dry_run_ports(role)
    left = _uncontrolled(role, given)
    assert not left, f"{role} leaves these Ray components to a port it does not control: {left}"
    assert {"ray_client_server_port", "min_worker_port", "max_worker_port"} <= given
    # Negative control: the worker of the failed CI run (no --ray-client-server-port, and a draw from 10000 up
    # that excluded no default) is caught, naming the client server.
    if role == "start-worker":
        old = _uncontrolled(role, given - {"ray_client_server_port"}, excluded=lambda port: False)
        assert "--ray-client-server-port (default 10001)" in old, old


def _check(ports: list[int], width: int, avoid: set[int], taken: list[tuple[int, int]], top: int) -> None:
    services, (first, last) = ports[:SERVICES], ports[SERVICES:]
    window = range(first, last + 1)
    assert len(window) == width
    assert len(set(services)) == SERVICES, f"a port drawn twice: {services}"
    every = set(services) | set(window)
    assert not [p for p in every if ports_mod.is_ray_default(p)], f"drew a Ray default: {ports}"
    assert not (set(services) & set(window)), ports
    assert not (every & avoid), (ports, avoid)
    assert not [p for p in every for a, b in taken if a <= p <= b], (ports, taken)
    assert all(ports_mod.LOWEST <= p < top for p in every), ports


def test_many_draws_hit_no_ray_default_and_no_other_component():
    rng = random.Random(1234)
    low = 32768
    for i in range(3000):
        width = rng.choice([1, 2, 50, 200, 500])
        avoid = {rng.randrange(1024, 40000) for _ in range(2)} | {6379, 8265}
        taken = [(s, s + 199) for s in (rng.randrange(20000, 32000) for _ in range(rng.randrange(0, 3)))]
        ports = ports_mod.pick(SERVICES, width, avoid, low=low, taken=taken, free=lambda p: True, rng=rng)
        _check(ports, width, avoid, taken, low)
    # Negative control: the check refuses the failed run's draw (10001 given to a service), and a clash.
    bad = [20001, 20002, 10001, 20004, 20005, 20006, 20007, 21000, 21199]
    with pytest.raises(AssertionError, match="drew a Ray default"):
        _check(bad, 200, set(), [], low)
    with pytest.raises(AssertionError, match="drawn twice"):
        _check([20001] * 7 + [21000, 21199], 200, set(), [], low)


def test_a_crowded_host_still_draws_no_default():
    # Only a few ports free: among them Ray's defaults and the default worker range, which must stay untouched.
    free = {6379, 8265, 10001, 52365} | set(range(10002, 20000)) | set(range(25000, 25010)) | set(range(30000, 31000))
    rng = random.Random(7)
    for _ in range(200):
        ports = ports_mod.pick(SERVICES, 200, {25003}, low=32768, taken=[], free=free.__contains__, rng=rng)
        _check(ports, 200, {25003}, [], 32768)
        assert 30000 <= ports[SERVICES] and ports[-1] <= 30999
    # Negative control: with no free window outside the defaults, the draw refuses instead of using them.
    with pytest.raises(RuntimeError, match="no window of 200 free worker ports"):
        ports_mod.pick(SERVICES, 200, (), low=32768, taken=[], free=(free - set(range(30000, 31000))).__contains__,
                       rng=rng)


def test_the_real_draw_on_this_host():
    """The script as ray_cluster.sh runs it: real free ports and the running raylets' windows."""
    low = ports_mod.ephemeral_low()
    taken = ports_mod.raylet_worker_ranges()
    for _ in range(20):
        out = subprocess.run([sys.executable, "scripts/ray_node_ports.py", str(SERVICES), "200", "6379", "8265"],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        ports = [int(p) for p in out.stdout.split()]
        assert len(ports) == SERVICES + 2
        _check(ports, 200, {6379, 8265}, taken, min(65536, low))
    bad = subprocess.run([sys.executable, "scripts/ray_node_ports.py", "7", "70000"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    most = min(65536, low) - ports_mod.LOWEST - 7 - 1
    assert bad.returncode == 1, bad.stderr
    assert (f"RAY_WORKER_PORTS=70000: at most {most} fit between 20000 and the ephemeral range (starts at {low})"
            in bad.stderr or most < 1 and "no worker window fits" in bad.stderr), bad.stderr


def test_a_wide_worker_window_never_reaches_into_the_ephemeral_range():
    """A window wider than the gap between 20000 and the ephemeral range is refused, never drawn into that range
    (the kernel hands its ports to any outgoing connection, so a worker's port could be taken at any time)."""
    rng = random.Random(3)
    # The widest window that fits still stays below the ephemeral range: 32768 - 20000 - 7 - 1 = 12760.
    for low, most in ((32768, 12760), (21000, 992)):
        for _ in range(10):
            ports = ports_mod.pick(SERVICES, most, (), low=low, taken=[], free=lambda p: True, rng=rng)
            _check(ports, most, set(), [], low)
        with pytest.raises(RuntimeError) as err:
            ports_mod.pick(SERVICES, most + 1, (), low=low, taken=[], free=lambda p: True, rng=rng)
        assert str(err.value).startswith(f"RAY_WORKER_PORTS={most + 1}: at most {most} fit between 20000 and the "
                                         f"ephemeral range (starts at {low})"), err.value
        assert f"Fix: set RAY_WORKER_PORTS={most} or lower" in str(err.value)
    # The case that drew into the ephemeral range before: 6000 ports on a host whose range starts at 25000.
    with pytest.raises(RuntimeError, match=r"RAY_WORKER_PORTS=6000: at most 4992 fit .* \(starts at 25000\)"):
        ports_mod.pick(SERVICES, 6000, (), low=25000, taken=[], free=lambda p: True, rng=rng)
    # An ephemeral range that starts at or below 20000 leaves no room at all.
    with pytest.raises(RuntimeError, match="no worker window fits between 20000 and the ephemeral range "
                                           r"\(starts at 10000\).*Fix: move the ephemeral range up"):
        ports_mod.pick(SERVICES, 1, (), low=10000, taken=[], free=lambda p: True, rng=rng)
    # Negative control: the check catches a draw that reaches into the ephemeral range (the old bound,
    # 20000 + 2 x 6000 + 1000 = 33000 on a host whose range starts at 25000, drew windows up to 32999).
    with pytest.raises(AssertionError):
        _check([20001, 20002, 20003, 20004, 20005, 20006, 20007, 26000, 31999], 6000, set(), [], 25000)


def _wait_nodes_with_a_node_owner(tmp_path: Path, owner_s: float, waiter_s: float) -> tuple[subprocess.CompletedProcess,
                                                                                            float]:
    """``ray_cluster.sh wait-nodes`` with RAY_NODE_DIR holding a running node owner (a stand-in whose command line
    reads like ``ray start --block``; it exits after owner_s) and a stand-in waiter (PYTHON: exits 0 after
    waiter_s). No Ray runs."""
    node = tmp_path / "node"
    node.mkdir()
    (node / "ray_start.log").write_text("Ray component dashboard_agent_http is trying to use a port number 10001 "
                                        "that is used by other components.\n")
    owner = subprocess.Popen(["bash", "-c", f"sleep {owner_s}; exit 0", "ray", "start", "--block"])
    (node / "ray_start.pid").write_text(f"{owner.pid}\n")
    fake_python = tmp_path / "python"
    fake_python.write_text(f"#!{sys.executable}\nimport time\ntime.sleep({waiter_s})\nprint('waited')\n")
    fake_python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(PYTHON=str(fake_python), RAY_NODE_DIR=str(node), NNODES="2", RAY_HEAD_IP="127.0.0.1",
               RAY_AUTH_MODE="disabled")
    start = time.monotonic()
    try:
        out = subprocess.run(["bash", "scripts/ray_cluster.sh", "wait-nodes"], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=60)
    finally:
        owner.kill()
        owner.wait()
    return out, time.monotonic() - start


def test_wait_nodes_ends_at_once_when_a_node_it_started_stops(tmp_path):
    out, wall = _wait_nodes_with_a_node_owner(tmp_path, owner_s=3, waiter_s=30)
    assert out.returncode == 1, out.stdout + out.stderr
    assert wall < 15, f"wait-nodes took {wall:.0f} s"
    node = tmp_path / "node"
    assert (f"error: the Ray node of {node} stopped while waiting for 2 node(s) (its ray start exited)"
            in out.stderr), out.stderr
    assert f"---- Ray node of {node}: last 40 lines of {node}/ray_start.log ----" in out.stderr
    assert "trying to use a port number 10001" in out.stderr and "waited" not in out.stdout
    assert not (node / "ray_start.pid").exists()


def test_negative_control_wait_nodes_with_its_node_alive_ends_with_the_waiter(tmp_path):
    out, wall = _wait_nodes_with_a_node_owner(tmp_path, owner_s=30, waiter_s=1)
    assert out.returncode == 0 and "waited" in out.stdout, out.stdout + out.stderr
    assert "stopped while waiting" not in out.stderr


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (a stopped waiter's parent may be gone, leaving it unreaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _signals_as_at_a_terminal(sigint: object = signal.SIG_DFL) -> None:
    """In the script's process before exec: SIGINT and SIGTERM at their defaults, as for a script that a terminal's
    shell runs in the foreground (what Ctrl-C reaches). Whatever started pytest may have left SIGINT ignored: a command
    that a non-interactive shell starts in the background (``cmd &``, ``nohup``, some CI runners) inherits SIGINT
    ignored, and bash cannot trap a signal that was ignored when it started, so the script would never see the
    signal (a busy-core run of the suite started that way failed here on a 30 s timeout: the test's start, not
    the script)."""
    signal.signal(signal.SIGINT, sigint)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _start_wait_nodes(tmp_path: Path, sigint: object = signal.SIG_DFL) -> tuple[subprocess.Popen, int]:
    """``ray_cluster.sh wait-nodes`` with a stand-in waiter (PYTHON: writes its pid, sleeps 60 s); returns the script
    and the waiter's pid once the waiter runs. No Ray runs."""
    pid_file = tmp_path / "waiter.pid"
    fake_python = tmp_path / "python"
    fake_python.write_text(f"#!{sys.executable}\nimport os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                           "time.sleep(60)\n")
    fake_python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(PYTHON=str(fake_python), RAY_NODE_DIR=str(tmp_path / "no_node"), NNODES="2",
               RAY_HEAD_IP="127.0.0.1", RAY_AUTH_MODE="disabled")
    script = subprocess.Popen(["bash", "scripts/ray_cluster.sh", "wait-nodes"], cwd=REPO, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              preexec_fn=lambda: _signals_as_at_a_terminal(sigint))
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        if script.poll() is not None:
            break
        time.sleep(0.1)
    if not (pid_file.exists() and pid_file.read_text()):
        status = script.poll()
        if status is None:
            script.kill()
            script.wait()
        pytest.fail(f"the stand-in waiter of wait-nodes did not start within 60 s (script exit {status})")
    return script, int(pid_file.read_text())


def _stop_wait_nodes(tmp_path: Path, sig: int) -> tuple[int, int, bool]:
    """Starts ``ray_cluster.sh wait-nodes`` with a stand-in waiter (:func:`_start_wait_nodes`), sends the script
    ``sig`` once the waiter runs; returns the script's exit status, the waiter's pid and whether the waiter still runs
    5 s later."""
    script, waiter = _start_wait_nodes(tmp_path)
    try:
        assert _running(waiter)
        script.send_signal(sig)
        status = script.wait(timeout=30)
        deadline = time.monotonic() + 5
        while _running(waiter) and time.monotonic() < deadline:
            time.sleep(0.1)
        return status, waiter, _running(waiter)
    finally:
        if script.poll() is None:
            script.kill()
            script.wait()
        if waiter and _running(waiter):
            os.kill(waiter, signal.SIGKILL)


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_stopping_wait_nodes_stops_its_waiter(tmp_path, sig, status):
    """Ctrl-C (SIGINT) or SIGTERM to ``wait-nodes`` ends its background waiter too (a script's background job
    ignores SIGINT), instead of leaving it polling the cluster for up to RAY_WAIT_TIMEOUT."""
    got, waiter, running = _stop_wait_nodes(tmp_path, sig)
    assert got == status, f"wait-nodes exited {got} on signal {sig}"
    assert not running, f"the waiter (pid {waiter}) still runs after wait-nodes stopped"


def test_control_sigint_ignored_when_the_script_starts_is_not_seen_by_it(tmp_path):
    """Why the checks above start the script with SIGINT at its default: started with SIGINT ignored (as under a
    background ``cmd &`` or ``nohup``), bash cannot trap it, and the script goes on waiting."""
    script, waiter = _start_wait_nodes(tmp_path, sigint=signal.SIG_IGN)
    try:
        script.send_signal(signal.SIGINT)
        with pytest.raises(subprocess.TimeoutExpired):
            script.wait(timeout=3)
        assert _running(waiter)
    finally:
        script.kill()
        script.wait()
        if _running(waiter):
            os.kill(waiter, signal.SIGKILL)


def test_negative_control_a_killed_wait_nodes_leaves_its_waiter_running(tmp_path):
    # SIGKILL runs no trap: the waiter survives, which the check above would report.
    got, waiter, running = _stop_wait_nodes(tmp_path, signal.SIGKILL)
    assert got == -signal.SIGKILL and running, (got, waiter, running)
