"""Megatron's checkpoint-writer results process ends with its rank (verl_ds4.engine.writer_queue).

A stand-in rank (a Python process that makes the queue as a save would, through the installed
Megatron-Core's own getter, and uses it) is SIGKILLed; the manager process serving the queue must be gone
within seconds, and the resource tracker beside it too. Negative control: the same with Megatron's own
queue (no install) leaves both alive, orphaned (what a CI run found after ``scancel`` under local Slurm).

The manager does not import the rank's main module (a trainer run as ``python -m verl.trainer.sft_trainer``: ~10 s
of imports at the first save): a stand-in rank run as a module logs each import of itself; ours is imported once,
Megatron's own spawned manager imports it again (the control).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

RANK = r"""
import sys, time
from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
if sys.argv[1] == "ours":
    from verl_ds4.engine import writer_queue
    manager = writer_queue.install()
    assert manager is not None and writer_queue.install() is manager
getter = getattr(fa, "get_write_results_queue", None) or fa._get_write_results_queue  # Megatron-Core 0.19 / 0.16
queue = getter()
if sys.argv[1] == "ours":
    assert getter() is not queue  # one queue per writer (concurrent async writers), all from the manager above
else:
    assert getter() is queue  # Megatron's: one cached queue for every writer
queue.put({"rank": 0})
assert queue.get() == {"rank": 0}
print("ready", flush=True)
time.sleep(600)
"""


def _children(pid: int) -> dict[int, str]:
    """``{pid: command line}`` of the live (not zombie) children of ``pid``."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[1]) != pid or stat[0] == "Z":
                continue
            found[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _kill_rank_and_watch(kind: str, wait_s: float) -> tuple[dict[int, str], list[int]]:
    """Start a stand-in rank (``kind``: ours / megatron), SIGKILL it once its queue works, and return its
    children (the manager, the resource tracker) and those still alive ``wait_s`` seconds later."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    rank = subprocess.Popen([sys.executable, "-c", RANK, kind], stdout=subprocess.PIPE, text=True, env=env)
    children: dict[int, str] = {}
    try:
        assert rank.stdout.readline().strip() == "ready", f"the stand-in rank failed (exit {rank.poll()})"
        children = _children(rank.pid)
        assert any("spawn_main" in cmd for cmd in children.values()), children  # the manager process
        rank.kill()
        rank.wait()
        deadline = time.monotonic() + wait_s
        while (left := [p for p in children if _alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        return children, left
    finally:
        rank.kill()
        rank.wait()


def test_the_writer_queue_process_ends_with_a_killed_rank():
    children, left = _kill_rank_and_watch("ours", wait_s=10.0)
    assert left == [], {p: children[p] for p in left}


def test_negative_control_megatrons_own_queue_process_outlives_the_killed_rank():
    children, left = _kill_rank_and_watch("megatron", wait_s=3.0)
    try:
        assert left, "Megatron's own manager process ended with its rank: the fix would not be needed"
        assert any("spawn_main" in children[p] for p in left), {p: children[p] for p in left}
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize("cached", [True, False])
def test_install_leaves_a_queue_megatron_already_made_alone(monkeypatch, cached):
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from verl_ds4.engine import writer_queue

    sentinel = object()
    monkeypatch.setattr(writer_queue, "_MANAGER", None)
    if cached:
        monkeypatch.setattr(filesystem_async, "_results_queue", sentinel)
        assert writer_queue.install() is None
        assert filesystem_async._results_queue is sentinel
    else:  # a Megatron without the cache: nothing to fill, nothing started
        monkeypatch.delattr(filesystem_async, "_results_queue")
        assert writer_queue.install() is None
        assert not hasattr(filesystem_async, "_results_queue")


def test_the_writer_queue_process_does_not_import_the_ranks_main_module(tmp_path):
    """The stand-in rank as ``python -m ds4_standin_rank``: every import of the module appends ``__name__ pid`` to a
    log. With our queue only the rank itself (``__main__``) is there once the queue works; with Megatron's own
    (spawn) manager, the manager process imported it too (``__mp_main__``): what the fix saves."""
    (tmp_path / "ds4_standin_rank.py").write_text(
        'import os\nwith open(os.environ["DS4_IMPORTS_LOG"], "a") as f:\n    f.write(f"{__name__} {os.getpid()}\\n")\n'
        'if __name__ == "__main__":\n' + "".join(f"    {line}\n" for line in RANK.strip().splitlines()))
    seen = {}
    for kind in ("ours", "megatron"):
        log = tmp_path / f"imports-{kind}.log"
        env = dict(os.environ, DS4_IMPORTS_LOG=str(log),
                   PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")]))
        rank = subprocess.Popen([sys.executable, "-m", "ds4_standin_rank", kind], stdout=subprocess.PIPE, text=True,
                                env=env)
        children = {}
        try:
            assert rank.stdout.readline().strip() == "ready", f"the stand-in rank ({kind}) failed (exit {rank.poll()})"
            children = _children(rank.pid)
            seen[kind] = sorted(line.split()[0] for line in log.read_text().splitlines())
        finally:
            rank.kill()
            rank.wait()
            for pid in children:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    assert seen["ours"] == ["__main__"], seen
    assert seen["megatron"] == ["__main__", "__mp_main__"], seen  # the control: spawn runs the main module again
