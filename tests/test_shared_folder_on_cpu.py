"""The start-up check that a multi-node run's checkpoint folder is one folder every node sees
(verl_ds4.recipes.shared_folder), with real processes as the nodes.

A node-local folder is made real with a mount namespace: "node 1" runs in its own (``unshare --user --map-root-user
--mount``) with a tmpfs mounted over the checkpoint folder, so it sees its own empty disk at the same path while
"node 0" sees the host's folder, as two machines with local disks would. Control: the same namespace without the
tmpfs sees the shared folder and passes. Skipped where this kernel refuses unprivileged user namespaces.
The launchers run the check on the local Slurm's two nodes and on the two-node Ray cluster
(tests/test_cluster_launchers_real_on_cpu.py asserts its fact line there).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verl_ds4.recipes import shared_folder
from verl_ds4.recipes.shared_folder import PROBE_DIR, SharedFolderError, probe, run_token

REPO = Path(__file__).resolve().parents[1]


def _cmd(folder: Path, rank: int, token: str = "t1", timeout: float = 60.0) -> list[str]:
    return [sys.executable, "-m", "verl_ds4.recipes.shared_folder", "--dir", str(folder), "--nodes", "2",
            "--node-rank", str(rank), "--token", token, "--timeout", str(timeout)]


def _start(cmd: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _both(first: list[str], second: list[str]) -> list[tuple[int, str, str]]:
    procs = [_start(first), _start(second)]
    outs = [p.communicate(timeout=180) for p in procs]
    return [(p.returncode, *o) for p, o in zip(procs, outs, strict=True)]


def _own_disk(folder: Path, cmd: list[str], mount: bool = True) -> list[str]:
    """``cmd`` in a mount namespace of its own, with a tmpfs over ``folder`` (its node-local disk) when ``mount``."""
    inner = (f"mount -t tmpfs tmpfs {folder} && " if mount else "") + 'exec "$@"'
    return ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", inner, "sh", *cmd]


def _userns_ok() -> bool:
    try:
        return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


needs_userns = pytest.mark.skipif(not _userns_ok(), reason="unprivileged user namespaces are off on this kernel "
                                  "(unshare --user --map-root-user --mount true fails): no node-local disk to make")


def test_two_nodes_on_one_folder_pass_and_leave_no_marker(tmp_path):
    folder = tmp_path / "checkpoints"
    results = _both(_cmd(folder, 0), _cmd(folder, 1))
    for rc, out, err in results:
        assert rc == 0, err
        assert f"[verl-ds4] checkpoint folder {folder} (shared: every one of the 2 nodes saw every node's marker)" in out
    assert not (folder / PROBE_DIR).exists()  # node 0 removed the markers once both had seen them


@needs_userns
def test_a_node_local_folder_is_refused_on_both_nodes_naming_the_folder_and_the_nodes(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    results = _both(_cmd(folder, 0, timeout=4), _own_disk(folder, _cmd(folder, 1, timeout=4)))
    (rc0, _, err0), (rc1, _, err1) = results
    assert rc0 == 2 and rc1 == 2, (err0, err1)
    assert f"the checkpoint folder {folder} is not shared by the run's 2 nodes: node 0" in err0
    assert "saw those of node(s) node0, not of node(s) node1" in err0
    assert "saw those of node(s) node1, not of node(s) node0" in err1
    assert "point CKPT_DIR (WORK_DIR for the CPU jobs) at a shared path" in err0


@needs_userns
def test_control_the_same_namespace_without_its_own_disk_passes(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    results = _both(_cmd(folder, 0), _own_disk(folder, _cmd(folder, 1), mount=False))
    assert [r[0] for r in results] == [0, 0], [r[2] for r in results]


def test_a_stale_marker_of_an_earlier_start_does_not_pass_a_lone_node(tmp_path):
    """A start killed inside its check leaves its markers; with the same token (the same rendezvous address) a
    later start must not take them for its nodes'. Control: a marker written now passes."""
    folder = tmp_path / "checkpoints"
    where = folder / PROBE_DIR / "t1"
    where.mkdir(parents=True)
    stale = where / "arrived.node1"
    stale.write_text("old\n")
    old = time.time() - 600
    os.utime(stale, (old, old))
    with pytest.raises(SharedFolderError, match="saw those of node\\(s\\) node0, not of node\\(s\\) node1"):
        probe(folder, 2, 0, "t1", timeout=1.0)
    stale.write_text("now\n")  # control: this start's node 1
    assert "shared" in probe(folder, 2, 0, "t1", timeout=5.0)


def test_one_node_passes_at_once_and_the_token_names_one_start():
    assert probe("/nonexistent/never/made", 1, 0, "t") == "/nonexistent/never/made (one node)"
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "2", "SLURM_RESTART_COUNT": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert run_token(slurm) == "slurm-7-1-2"
    assert run_token({**slurm, "SLURM_STEP_ID": "3"}) != run_token(slurm)  # a restart is a new srun step
    assert run_token({"MASTER_ADDR": "h", "MASTER_PORT": "1", "DS4_RESTART": "2"}) == "rdzv-h-1-2"
    assert run_token({}) is None


def test_the_command_refuses_missing_ranks_and_a_start_it_cannot_name(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        shared_folder.main(["--dir", str(tmp_path), "--nodes", "2"])
    assert e.value.code == 2 and "give --nodes N and --node-rank R" in capsys.readouterr().err
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    done = subprocess.run([sys.executable, "-m", "verl_ds4.recipes.shared_folder", "--dir", str(tmp_path),
                           "--nodes", "2", "--node-rank", "0"], cwd=REPO, env={**env, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "give --token, the same on every node" in done.stderr


def test_the_launchers_knobs_skip_the_check_saying_so_and_bad_values_are_refused(tmp_path):
    """``SHARED_CKPT_CHECK=0`` (a one-machine rehearsal of a multi-node launch) skips the check and says so; control:
    the same lone node with the check on and a 1-second ``SHARED_CKPT_TIMEOUT`` is refused."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SHARED_CKPT_")}
    base["PYTHONPATH"] = str(REPO)
    cmd = _cmd(tmp_path, 0)[:-2]  # no --timeout: the knob's
    done = subprocess.run(cmd, cwd=REPO, env={**base, "SHARED_CKPT_CHECK": "0"}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "not checked for being shared by every node (SHARED_CKPT_CHECK=0)" in done.stdout
    done = subprocess.run(cmd, cwd=REPO, env={**base, "SHARED_CKPT_TIMEOUT": "1"}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "is not shared by the run's 2 nodes" in done.stderr, done.stderr
    for knob, value, words in (("SHARED_CKPT_CHECK", "yes", "expected 1 (check that every node sees"),
                               ("SHARED_CKPT_TIMEOUT", "soon", "expected a positive number of seconds")):
        done = subprocess.run(cmd, cwd=REPO, env={**base, knob: value}, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and f"{knob}={value}: {words}" in done.stderr, done.stderr
