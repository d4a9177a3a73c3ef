"""The README's first steps match what happens.

* The README's example output of ``bash scripts/dev.sh demo`` is the console the launcher's defaults
  produce: the start-up facts equal :class:`SFTConsole`'s header for the arguments the launcher passes
  (run here with a stand-in Python that records them, no training), the progress lines are the steps
  that console prints (``step N/STEPS``), the summary's run folder, step count and "fell by" agree with
  the shown loss means, and the rerun lines equal :func:`finished_run_lines`. Negative control: the
  README's former block (``step 8/8``, ``runs/readme``) fails the same check.
* The first-steps pages say how to reach ``verl-ds4`` (``source .venv/bin/activate`` or ``.venv/bin/``).
* ``doctor`` labels a machine without an accelerator ``cpu`` (keeping an explicit ``VERL_ENGINE_VENDOR``).
* A rerun of a finished run says it is complete and runs nothing (no ``step 81/80``); an override of the run's
  folder, resume mode or length (``key=``, ``+key=``, ``++key=``, ``~key``) turns that check off.
* The GRPO CPU launcher reads ``actor_rollout_ref.rollout.n`` also when written ``+key=`` / ``++key=``.
"""

from __future__ import annotations

import json
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from verl_ds4.cpu import console
from verl_ds4.cpu.console_sft import SFTConsole, finished_run_lines
from verl_ds4.engine import doctor_cli

REPO = Path(__file__).resolve().parents[1]
STAMP = re.compile(r"\d{8}-\d{6}")

OLD_README_BLOCK = """\
[verl-ds4] CP layout   contiguous (cp=2, tp=1, >= 128 rows per CP rank), resolved by CPUMegatronEngineWithLMHead
[verl-ds4] step 8/8 | loss 3.0511 | 1243 tok/s | elapsed 11s | ETA 0s
[verl-ds4] result      training worked: the loss fell by 22%
[verl-ds4] checkpoint  runs/readme/checkpoints/global_step_8
"""


def _blocks(text: str, lang: str = "") -> list[str]:
    """The fenced blocks whose info string is ``lang``, in order."""
    blocks, current, info = [], None, ""
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current, info = [], line[3:].strip()
            else:
                if info == lang:
                    blocks.append("\n".join(current) + "\n")
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def _readme_blocks() -> tuple[list[str], list[str]]:
    """(the demo's output lines, the rerun's lines) of the README's "Two commands" section."""
    section = REPO.joinpath("README.md").read_text().split("## Two commands", 1)[1].split("\n## ", 1)[0]
    plain = [b for b in _blocks(section) if b.startswith("[verl-ds4]")]
    assert len(plain) == 2, "expected the demo's output block and the rerun's block"
    return plain[0].splitlines(), plain[1].splitlines()


def _launcher_console_argv(tmp: Path, *overrides: str) -> list[str]:
    """The console's arguments as the SFT CPU launcher passes them for ``overrides`` (a stand-in Python records
    them; nothing trains)."""
    record = tmp / "args.json"
    shim = tmp / "python"
    shim.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$2" = verl_ds4.cpu.console ]; then\n'
        f'  exec {sys.executable} -c \'import json, sys; json.dump(sys.argv[1:], open(sys.argv[1], "w"))\' {record} "$@"\n'
        "fi\n"
        "exit 0\n"  # the assets, the override check: not needed to know what the console is told
    )
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(shim), "HOME": str(tmp)}
    out = subprocess.run(["bash", str(REPO / "scripts" / "run_ds4_proxy_sft_cpu.sh"), *overrides], env=env, cwd=tmp,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    argv = json.loads(record.read_text())[3:]  # after "-m verl_ds4.cpu.console sft"
    return argv[: argv.index("--")]


@pytest.fixture(scope="module")
def console_args(tmp_path_factory) -> dict:
    """The console's arguments as the demo's launcher passes them (a stand-in Python records them)."""
    argv = _launcher_console_argv(tmp_path_factory.mktemp("readme"))
    args = {"facts": [], "finished_check": None}
    it = iter(argv)
    for flag in it:
        if flag == "--fact":
            key, _, value = next(it).partition("=")
            args["facts"].append((key, value))
        elif flag in ("--work-dir", "--steps", "--every", "--finished-check"):
            args[flag[2:].replace("-", "_")] = next(it)
    return args


def demo_mismatches(lines: list[str], args: dict) -> list[str]:
    """Lines of a shown demo output that the console, given the launcher's arguments, would not print."""
    work_dir, steps, every = args["work_dir"], int(args["steps"]), int(args["every"])
    view = SFTConsole(work_dir, steps, facts=args["facts"], every=every)
    problems = []
    header = view.header(Path(work_dir) / "logs" / "STAMP.log")
    shown_header = [STAMP.sub("STAMP", line) for line in lines[: len(header)]]
    if shown_header != header:
        problems.append(f"start-up facts differ: {shown_header} != {header}")
    printed = {1, steps} | set(range(view.every, steps + 1, view.every))
    step_re = re.compile(rf"^\[verl-ds4\] step (\d+)/{steps} \| loss \d+\.\d{{4}} \| \d+ tok/s \| elapsed \S+ \| ETA \S+$")
    shown_steps = []
    for line in lines:
        if line.startswith("[verl-ds4] step "):
            m = step_re.match(line)
            if not m or int(m.group(1)) not in printed:
                problems.append(f"not a progress line of a {steps}-step run: {line}")
            else:
                shown_steps.append(int(m.group(1)))
    if not shown_steps or shown_steps[-1] != steps:
        problems.append(f"the last progress line shown is not step {steps}/{steps}")
    text = "\n".join(lines)
    loss = re.search(r"loss        first (\d+)-step mean ([0-9.]+) -> last \1-step mean ([0-9.]+) \(([-+][0-9.]+)%\)", text)
    result = re.search(r"result      training worked: the loss fell by (\d+)%", text)
    if not loss or not result:
        problems.append("no loss trend / result line")
    else:
        change = (float(loss.group(3)) - float(loss.group(2))) / float(loss.group(2))
        if f"{-change:.0%}" != f"{result.group(1)}%" or f"{change:+.1%}" != f"{loss.group(4)}%":
            problems.append(f"'fell by {result.group(1)}%' does not follow from the loss means")
    for want in (f"[verl-ds4] steps       {steps} in this run (steps 1-{steps} of {steps})",
                 f"[verl-ds4] checkpoint  {work_dir}/checkpoints/global_step_{steps}",
                 f"[verl-ds4] loss plot   {work_dir}/loss.png"):
        if want not in lines:
            problems.append(f"missing: {want}")
    log = [STAMP.sub("STAMP", line) for line in lines if line.startswith("[verl-ds4] full log")]
    if log != [f"[verl-ds4] full log    {work_dir}/logs/STAMP.log"]:
        problems.append(f"full log line: {log}")
    return problems


def test_readme_demo_output_is_what_the_launcher_defaults_print(console_args):
    demo, _ = _readme_blocks()
    assert console_args["work_dir"] == "runs/ds4_sft_cpu" and console_args["steps"] == "80"
    assert demo_mismatches(demo, console_args) == []
    # negative control: the README's former block (an 8-step run into runs/readme) is caught
    assert demo_mismatches(OLD_README_BLOCK.splitlines(), console_args)


def test_readme_rerun_lines_are_the_finished_run_lines(console_args, tmp_path):
    _, rerun = _readme_blocks()
    steps, work_dir = int(console_args["steps"]), console_args["work_dir"]
    assert console_args["finished_check"] == f"{work_dir}/checkpoints"
    ckpt = tmp_path / "checkpoints"
    (ckpt / f"global_step_{steps}").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text(str(steps))
    lines = [line.replace(str(tmp_path), work_dir) for line in finished_run_lines(ckpt, steps)]
    assert rerun[: len(lines)] == lines
    assert not any(f"step {steps + 1}" in line for line in rerun)


def test_first_steps_say_how_to_reach_the_command():
    readme = REPO.joinpath("README.md").read_text()
    assert "source .venv/bin/activate" in readme and ".venv/bin/verl-ds4" in readme
    for page in ("README.md", "docs/index.md", "docs/quickstart.md"):
        for block in _blocks(REPO.joinpath(page).read_text(), "bash"):
            activated = False
            for line in block.splitlines():
                activated = activated or line.startswith("source .venv/bin/activate")
                assert activated or not line.startswith("verl-ds4"), f"{page}: bare `{line}` before activating .venv"


# ----------------------------------------------------------------------------------------- doctor


def test_doctor_says_cpu_without_an_accelerator(monkeypatch):
    monkeypatch.delenv("VERL_ENGINE_DEVICE", raising=False)
    monkeypatch.delenv("VERL_ENGINE_VENDOR", raising=False)
    monkeypatch.setattr(doctor_cli, "_has_accelerator", lambda: False)
    # verl's fallback platform on a machine without an accelerator is its CUDA one
    assert doctor_cli.this_machine(lambda: "cuda", lambda: "nvidia") == ("cpu", "cpu", "this machine (cpu, no accelerator)")
    assert doctor_cli.this_machine(lambda: "cpu", lambda: "cpu") == ("cpu", "cpu", "this machine (cpu/cpu)")
    # negative control: with an accelerator, verl's answer stands
    monkeypatch.setattr(doctor_cli, "_has_accelerator", lambda: True)
    assert doctor_cli.this_machine(lambda: "cuda", lambda: "nvidia") == ("cuda", "nvidia", "this machine (cuda/nvidia)")


def test_doctor_keeps_an_explicit_vendor_without_an_accelerator(monkeypatch):
    monkeypatch.delenv("VERL_ENGINE_DEVICE", raising=False)
    monkeypatch.setenv("VERL_ENGINE_VENDOR", "acme")
    monkeypatch.setattr(doctor_cli, "_has_accelerator", lambda: False)
    # the device falls back to cpu; VERL_ENGINE_VENDOR is the user's and is taken as it is
    assert doctor_cli.this_machine(lambda: "cuda", lambda: "nvidia") == ("cpu", "acme",
                                                                         "this machine (cpu/acme, no accelerator)")
    # negative control: without VERL_ENGINE_VENDOR the vendor is cpu, as the check above would not accept
    monkeypatch.delenv("VERL_ENGINE_VENDOR")
    assert doctor_cli.this_machine(lambda: "cuda", lambda: "nvidia")[1] == "cpu"


def test_this_cpu_machine_has_no_accelerator():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert doctor_cli._has_accelerator() is False


# ------------------------------------------------------------------------------ rerun of a finished run


def _checkpoints(tmp_path: Path, step: int) -> Path:
    ckpt = tmp_path / "checkpoints"
    (ckpt / f"global_step_{step}").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text(str(step))
    return ckpt


@pytest.mark.parametrize("override", [
    "trainer.resume_mode=disable", "+trainer.resume_mode=disable", "++trainer.resume_mode=disable",
    "++trainer.default_local_dir=/elsewhere", "+trainer.total_training_steps=160", "~trainer.resume_mode",
])
def test_an_override_of_the_run_turns_the_finished_check_off(tmp_path, override):
    """An override that moves the run's folder, its resume mode or its length, in any of Hydra's spellings, leaves
    the rerun to the trainer: the console's finished check (for the launcher's own folder and STEPS) would
    otherwise say "complete" for a run the override changed."""
    argv = _launcher_console_argv(tmp_path, "data.micro_batch_size_per_gpu=1", override)
    assert "--finished-check" not in argv, f"{override}: the launcher still passes --finished-check"


@pytest.mark.parametrize("override", ["+trainer.resume_modes=x", "+trainer.seed=3", "data.resume_mode=x"])
def test_negative_control_other_overrides_keep_the_finished_check(tmp_path, override):
    argv = _launcher_console_argv(tmp_path, override)
    assert "--finished-check" in argv, f"{override}: the launcher dropped --finished-check"


def test_rerun_of_a_finished_run_trains_nothing(tmp_path, capsys):
    ckpt = _checkpoints(tmp_path, 80)
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "old.log").write_text("".join(f"[verl-ds4] step {s} | loss {5 - s / 40:.4f} | 900 tok/s | elapsed {s}.0s\n"
                                          for s in range(1, 81)))
    (logs / "latest.log").symlink_to("old.log")
    # the command would fail if it ran
    rc = console.main(["sft", "--work-dir", str(tmp_path), "--steps", "80", "--finished-check", str(ckpt),
                       "--fact", "job=SFT", "--", sys.executable, "-c", "raise SystemExit(3)"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.splitlines()[:3] == [
        "[verl-ds4] job         SFT",
        f"[verl-ds4] resume      from step 80 ({ckpt}/global_step_80): the run is complete (80 of 80 steps); nothing to train",
        "[verl-ds4]             raise STEPS to train on (e.g. STEPS=160), or start over with RESUME_MODE=disable or another WORK_DIR",
    ]
    assert "step 81" not in out and "result      training worked" in out
    assert len(list(logs.glob("*.log"))) == 2  # no new log: nothing ran


def test_rerun_of_an_unfinished_run_runs(tmp_path, capsys):
    ckpt = _checkpoints(tmp_path, 40)  # negative control: 40 of 80 resumes and trains
    assert finished_run_lines(ckpt, 80) is None
    rc = console.main(["sft", "--work-dir", str(tmp_path), "--steps", "80", "--finished-check", str(ckpt), "--no-plot",
                       "--", sys.executable, "-c", "raise SystemExit(3)"])
    assert rc == 3


@pytest.mark.parametrize("override, refused", [
    ("++actor_rollout_ref.rollout.n=1", True), ("+actor_rollout_ref.rollout.n=1", True),
    ("++actor_rollout_ref.rollout.n=2", False),  # negative control: a group of two passes the check
])
def test_grpo_launcher_reads_rollout_n_in_any_spelling(tmp_path, override, refused):
    shim = tmp_path / "python"
    shim.write_text("#!/usr/bin/env bash\nexit 0\n")  # nothing past the launcher's own checks runs
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(shim), "DS4_RL_RECIPE": "grpo", "WORK_DIR": str(tmp_path / "run"),
           "HOME": str(tmp_path)}
    out = subprocess.run(["bash", str(REPO / "scripts" / "run_ds4_proxy_ppo_cpu.sh"), override], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    said = f"{override}: GRPO needs actor_rollout_ref.rollout.n > 1" in out.stderr
    assert said == refused, out.stderr
    if refused:
        assert out.returncode == 2 and not (tmp_path / "run" / "assets").exists()
