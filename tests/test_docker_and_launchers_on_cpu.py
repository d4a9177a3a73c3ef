"""CPU checks of the GPU image (docker/) and the cluster launchers (scripts/).

- hadolint on docker/Dockerfile and shellcheck on every shell script of the repository (both linters
  come from the `test` extra as static binaries; no network, no Docker engine needed);
- the pins: the Dockerfile's build-argument defaults, the table in docker/README.md, pyproject.toml,
  the installed verl's own extras, and every Megatron commit mentioned anywhere in the repository;
- docker/verify_image.py's version check against this venv;
- the --dry-run of every cluster launcher: exit 0, the expected commands, and nothing run (fake
  `ray`, `srun`, `sbatch`, `scontrol` on PATH record any call).
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "Dockerfile"
DOCKER_README = REPO / "docker" / "README.md"
SKIP_DIRS = {".git", ".venv", "venv", "node_modules", "build", "dist", "__pycache__", ".pytest_cache", "outputs", "runs", "checkpoints"}
RECIPE_KNOBS = ["MODEL_PATH", "TRAIN_FILES", "VAL_FILES", "NNODES", "GPUS_PER_NODE", "PP", "EP", "CP",
                "ROLLOUT_ENGINE", "ROLLOUT_TP", "CKPT_DIR", "PROJECT_NAME", "EXP_NAME"]


def _tool(name: str) -> str:
    """A linter from the test extra: next to this interpreter first, then on PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found: install the test extra (pip install -e '.[test]')")
    return found


def _repo_files():
    """The repository's own files: git's tracked and untracked-but-not-ignored ones, so a venv
    (lane 2 creates .venv312 while lane 1 runs) or any other ignored output is never scanned. Without
    git (an exported tree), a walk that skips SKIP_DIRS and every .venv* folder."""
    if shutil.which("git") and (REPO / ".git").exists():
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, text=True, cwd=REPO, check=True)
        for rel in out.stdout.split("\0"):
            if rel and (REPO / rel).is_file():
                yield REPO / rel
        return
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".venv") and not d.endswith(".egg-info")]
        for f in files:
            yield Path(root) / f


# ----------------------------------------------------------------------------------------- linters


def test_hadolint_passes_on_dockerfile():
    out = subprocess.run([_tool("hadolint"), "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert out.returncode == 0, f"hadolint findings:\n{out.stdout}{out.stderr}"


def test_hadolint_flags_a_bad_dockerfile(tmp_path):
    # The linter really lints: an unpinned apt/pip install and `cd` in RUN are reported.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:24.04\nRUN apt-get install -y curl && pip install requests\nRUN cd /tmp\n")
    out = subprocess.run([_tool("hadolint"), "--no-color", str(bad)], capture_output=True, text=True)
    assert out.returncode != 0
    assert "DL3008" in out.stdout and "DL3013" in out.stdout and "DL3003" in out.stdout


def _shell_scripts() -> list[Path]:
    scripts = []
    for path in _repo_files():
        rel = path.relative_to(REPO).as_posix()
        if path.suffix in (".sh", ".sbatch") or rel == ".ci/run":
            scripts.append(path)
    return sorted(scripts)


def test_shellcheck_passes_on_every_shell_script():
    scripts = _shell_scripts()
    rels = {p.relative_to(REPO).as_posix() for p in scripts}
    # The glob finds the scripts known today (and whatever is added later).
    assert {".ci/run", "scripts/dev.sh", "scripts/cluster_lib.sh", "scripts/ray_cluster.sh", "scripts/slurm_submit.sh",
            "scripts/slurm_sft.sbatch", "scripts/slurm_ray_rl.sbatch"} <= rels
    out = subprocess.run(
        [_tool("shellcheck"), "--external-sources", "--format=gcc", *[str(p.relative_to(REPO)) for p in scripts]],
        capture_output=True, text=True, cwd=REPO,
    )
    assert out.returncode == 0, f"shellcheck findings:\n{out.stdout}{out.stderr}"


def test_shellcheck_flags_a_bad_script(tmp_path):
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/usr/bin/env bash\nrm -rf $1/*\n")
    out = subprocess.run([_tool("shellcheck"), str(bad)], capture_output=True, text=True)
    assert out.returncode != 0 and "SC2086" in out.stdout


# -------------------------------------------------------------------------------------------- pins


def _dockerfile_args() -> tuple[dict[str, str], dict[str, str], list[str]]:
    """(pins, build settings, stage ARG lines) from docker/Dockerfile."""
    pins, settings, stage_args = {}, {}, []
    section = None
    seen_from = False
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("# ---- pins"):
            section = pins
        elif line.startswith("# ---- build settings"):
            section = settings
        if line.startswith("FROM "):
            seen_from = True
        m = re.match(r"ARG\s+([A-Z0-9_]+)(?:=(.*))?$", line.strip())
        if not m:
            continue
        if seen_from:
            stage_args.append(line.strip())
        else:
            assert section is not None, f"ARG before the pins block: {line}"
            section[m.group(1)] = (m.group(2) or "").strip('"')
    return pins, settings, stage_args


def _readme_pins() -> dict[str, str]:
    rows = {}
    for line in DOCKER_README.read_text().splitlines():
        m = re.match(r"\|\s*`([A-Z0-9_]+)`\s*\|\s*`([^`]+)`\s*\|\s*(.+?)\s*\|\s*$", line)
        if m:
            assert m.group(3).strip(), f"README pin {m.group(1)} has no reason"
            rows[m.group(1)] = m.group(2)
    return rows


def test_every_pin_is_a_build_arg_with_one_default():
    pins, settings, stage_args = _dockerfile_args()
    assert {"PYTHON_VERSION", "TORCH_VERSION", "VLLM_VERSION", "TRANSFORMER_ENGINE_VERSION", "MEGATRON_LM_COMMIT",
            "MEGATRON_BRIDGE_COMMIT", "CUTLASS_DSL_VERSION", "VERL_VERSION", "FLASH_MLA_COMMIT",
            "FAST_HADAMARD_TRANSFORM_COMMIT", "CUDNN_FRONTEND_COMMIT"} <= set(pins)
    assert all(pins.values()), "every pin needs a default"
    # The stage re-declares every argument it uses, without a value (the default lives above only).
    redeclared = {a.split()[1] for a in stage_args}
    assert all("=" not in a for a in stage_args), f"a default inside the stage: {stage_args}"
    assert redeclared == (set(pins) - {"CUDA_IMAGE"}) | set(settings)
    # No pin value is spelled out anywhere else in the Dockerfile's instructions.
    instructions = [line for line in DOCKERFILE.read_text().splitlines()
                    if line.strip() and not line.lstrip().startswith("#") and not line.startswith("ARG ")]
    for name, value in pins.items():
        for line in instructions:
            assert value not in line, f"{name}'s value {value} is hard-coded outside its ARG: {line.strip()}"


def test_readme_table_matches_the_dockerfile():
    pins, _, _ = _dockerfile_args()
    assert _readme_pins() == pins


def test_pins_agree_with_pyproject_and_verl():
    pins, _, _ = _dockerfile_args()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert SpecifierSet(project["requires-python"]).contains(pins["PYTHON_VERSION"] + ".0")
    reqs = [Requirement(r) for r in project["dependencies"]]
    env312 = {"python_version": pins["PYTHON_VERSION"], "python_full_version": pins["PYTHON_VERSION"] + ".0"}
    by_name = {r.name: r for r in reqs if r.marker is None or r.marker.evaluate(env312)}
    assert str(by_name["verl"].specifier) == f"=={pins['VERL_VERSION']}"
    assert by_name["torch"].specifier.contains(pins["TORCH_VERSION"])

    # The installed verl (pinned by pyproject) is the release the image installs, and its own extras
    # pin the same vLLM / torch / flash-attn / modelopt; its transformers range admits ours.
    assert md.version("verl") == pins["VERL_VERSION"]
    extras: dict[str, dict[str, Requirement]] = {}
    base: dict[str, Requirement] = {}
    for raw in md.requires("verl") or []:
        r = Requirement(raw)
        m = re.search(r'extra\s*==\s*"([^"]+)"', str(r.marker)) if r.marker else None
        (extras.setdefault(m.group(1), {}) if m else base)[r.name] = r
    vllm_extra = extras["vllm"]
    assert str(vllm_extra["vllm"].specifier) == f"=={pins['VLLM_VERSION']}"
    for dist, pin in [("torch", "TORCH_VERSION"), ("torchvision", "TORCHVISION_VERSION"),
                      ("torchaudio", "TORCHAUDIO_VERSION")]:
        assert str(vllm_extra[dist].specifier) == f"=={pins[pin]}", dist
    # verl names its flash-attn extra after the CUDA and torch it targets: the image's CUDA and torch.
    cuda = re.search(r":(\d+)\.(\d+)\.\d+-", pins["CUDA_IMAGE"])
    torch_major_minor = "".join(pins["TORCH_VERSION"].split(".")[:2])
    flash_extra = f"flash-attn-cu{cuda.group(1)}{cuda.group(2)}torch{torch_major_minor}"
    assert flash_extra in extras, f"verl 0.9.1 has no {flash_extra} extra: {sorted(extras)}"
    assert str(extras[flash_extra]["flash-attn"].specifier) == f"=={pins['FLASH_ATTN_VERSION']}"
    assert str(extras["megatron"]["nvidia-modelopt"].specifier) == f"=={pins['NVIDIA_MODELOPT_VERSION']}"
    assert base["transformers"].specifier.contains(pins["TRANSFORMERS_VERSION"])
    assert SpecifierSet(md.metadata("verl")["Requires-Python"]).contains(pins["PYTHON_VERSION"] + ".0")
    assert pins["CUDA_IMAGE"].endswith("ubuntu24.04") and pins["PYTHON_VERSION"] == "3.12", \
        "Ubuntu 24.04 is the base whose system Python is 3.12"


def test_megatron_commits_are_the_same_everywhere_in_the_repo():
    pins, _, _ = _dockerfile_args()
    want = {"Megatron-LM": pins["MEGATRON_LM_COMMIT"], "Megatron-Bridge": pins["MEGATRON_BRIDGE_COMMIT"]}
    # A full or abbreviated commit (7-40 hex digits, at least one letter) after the project's name.
    pattern = re.compile(r"(Megatron-LM|Megatron-Bridge)\W[^\n]{0,120}?\b(?=[0-9]*[a-f])([0-9a-f]{7,40})\b")
    mentions = 0
    for path in _repo_files():
        if path.suffix not in {".md", ".sh", ".sbatch", ".py", ".toml", ".yaml", ".yml", ".txt", ""} or path == DOCKERFILE:
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for m in pattern.finditer(text):
            mentions += 1
            assert want[m.group(1)].startswith(m.group(2)), (
                f"{path.relative_to(REPO)} names {m.group(1)} commit {m.group(2)}, the image pins {want[m.group(1)]}"
            )
    assert mentions >= 2  # at least docker/README.md's


def test_dockerfile_copies_only_files_that_exist():
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                if not src.startswith("--"):
                    assert (REPO / src).exists(), f"COPY source {src} is missing"


def _load_verify_image():
    spec = importlib.util.spec_from_file_location("verify_image", REPO / "docker" / "verify_image.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_verify_image_reports_mismatches(tmp_path):
    verify_image = _load_verify_image()
    constraints = tmp_path / "constraints.txt"
    git_pins = tmp_path / "git-pins.txt"
    constraints.write_text(f"pytest=={md.version('pytest')}\nverl=={md.version('verl')}\n")
    git_pins.write_text("")
    assert verify_image.check_versions(str(constraints), str(git_pins)) == []

    constraints.write_text("pytest==0.0.1\nno-such-dist-verl-ds4==1.0\n")
    git_pins.write_text("verl " + "0" * 40 + "\n")
    problems = verify_image.check_versions(str(constraints), str(git_pins))
    assert any(p.startswith("pytest: installed") and "pinned 0.0.1" in p for p in problems)
    assert any(p.startswith("no-such-dist-verl-ds4: not installed") for p in problems)
    assert any(p.startswith("verl: installed from commit None") for p in problems)  # a wheel, not a git install


# -------------------------------------------------------------------------------- launcher dry runs


@pytest.fixture
def fake_bin(tmp_path):
    """A PATH entry whose ray/srun/sbatch/scontrol record any call, so a dry run that runs something fails."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.log"
    for name in ("ray", "srun", "sbatch", "scontrol", "torchrun"):
        tool = bin_dir / name
        tool.write_text(f'#!/bin/sh\necho "{name} $*" >> "{calls}"\n')
        tool.chmod(0o755)
    return bin_dir, calls


def _run(script: str, *args: str, fake_bin, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    bin_dir, _ = fake_bin
    base = {k: v for k, v in os.environ.items()
            if k not in RECIPE_KNOBS and not k.startswith(("SLURM_", "RAY_", "VERL_", "NCCL_", "PET_"))}
    base.update({"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHON": sys.executable})
    base.update(env or {})
    return subprocess.run(["bash", script, *args], capture_output=True, text=True, cwd=REPO, env=base)


def _commands(stdout: str) -> list[list[str]]:
    """The printed commands (lines starting with '+', any indent), split as bash would."""
    cmds = []
    for line in stdout.splitlines():
        stripped = line.strip()
        if stripped.startswith("+ "):
            words = shlex.split(stripped[2:])
            if words and words[-1] == "&":
                words = words[:-1]
            cmds.append(words)
    return cmds


def _find(cmds: list[list[str]], *prefix: str) -> list[list[str]]:
    return [c for c in cmds if c[: len(prefix)] == list(prefix)]


def _supervised_srun(cmds: list[list[str]]) -> list[str]:
    """The srun step of the SFT batch script: the command its restart supervisor runs (after its ``--``)."""
    [supervisor] = [c for c in cmds if len(c) > 1 and c[1] == str(REPO / "scripts" / "supervise.py")]
    assert supervisor[supervisor.index("--max-restarts") + 1] == "3" and "--requeue-signal" in supervisor
    srun = supervisor[supervisor.index("--") + 1:]
    assert srun[0] == "srun" and not _find(cmds, "srun"), cmds
    return srun


def _assert_nothing_ran(fake_bin):
    _, calls = fake_bin
    assert not calls.exists(), f"--dry-run ran commands: {calls.read_text()}"


def _runtime_env(submit: list[str]) -> dict:
    [arg] = [a for a in submit if a.startswith("--runtime-env-json=")]
    return json.loads(arg.split("=", 1)[1])


PPO_4_NODES = {"NNODES": "4", "GPUS_PER_NODE": "8", "MODEL_PATH": "/ckpt/DeepSeek-V4-Flash",
               "TRAIN_FILES": "/data/rl/train.parquet", "VAL_FILES": "/data/rl/test.parquet", "CP": "2",
               "EXP_NAME": "ds4_flash_ppo", "RAY_HEAD_IP": "10.0.0.1"}


@pytest.mark.parametrize("recipe", ["ppo", "grpo"])
def test_ray_submit_dry_run(recipe, fake_bin):
    env = dict(PPO_4_NODES, WANDB_API_KEY="secret-value", EXTRA_ENV_VARS="WANDB_API_KEY HF_HOME", HF_HOME="/hf",
               ROLLOUT_QUANT="fp8")
    out = _run("scripts/ray_cluster.sh", "--dry-run", "submit", recipe, "trainer.total_epochs=1",
               "actor_rollout_ref.rollout.n=8", fake_bin=fake_bin, env=env)
    assert out.returncode == 0, out.stderr
    _assert_nothing_ran(fake_bin)
    [submit] = _find(_commands(out.stdout), "ray", "job", "submit")
    assert "--address=http://10.0.0.1:8265" in submit
    entry = submit[submit.index("--") + 1:]
    assert entry == ["bash", f"scripts/run_deepseek_v4_flash_{recipe}_megatron.sh", "trainer.total_epochs=1",
                     "actor_rollout_ref.rollout.n=8"]
    runtime_env = _runtime_env(submit)
    assert runtime_env["working_dir"] == str(REPO)
    assert ".venv" in runtime_env["excludes"] and ".git" in runtime_env["excludes"]
    env_vars = runtime_env["env_vars"]
    # ROLLOUT_QUANT is a knob of the PPO launcher only, which the GRPO launcher delegates to
    for knob in ("NNODES", "GPUS_PER_NODE", "MODEL_PATH", "TRAIN_FILES", "VAL_FILES", "CP", "EXP_NAME", "ROLLOUT_QUANT"):
        assert env_vars[knob] == env[knob], knob
    assert "PP" not in env_vars  # unset knobs keep the local launcher's defaults
    assert env_vars["VERL_USE_EXTERNAL_MODULES"].startswith("verl_ds4")
    assert env_vars["HF_HOME"] == "/hf"
    assert env_vars["WANDB_API_KEY"] == "***" and "secret-value" not in out.stdout


def test_ray_submit_carries_the_plugin_named_by_pyproject_or_the_user(fake_bin):
    out = _run("scripts/ray_cluster.sh", "--dry-run", "submit", "ppo", fake_bin=fake_bin,
               env={"VERL_USE_EXTERNAL_MODULES": "my_plugin.mod"})
    assert out.returncode == 0, out.stderr
    [submit] = _find(_commands(out.stdout), "ray", "job", "submit")
    assert _runtime_env(submit)["env_vars"]["VERL_USE_EXTERNAL_MODULES"] == "my_plugin.mod"

    # Without an override: the modules of our `verl.plugins` entry points (the package when none yet).
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    entry_points = project.get("entry-points", {}).get("verl.plugins", {})
    expected = ",".join(v.split(":")[0].strip() for v in entry_points.values()) or "verl_ds4"
    out = _run("scripts/ray_cluster.sh", "--dry-run", "submit", "grpo", fake_bin=fake_bin)
    [submit] = _find(_commands(out.stdout), "ray", "job", "submit")
    assert _runtime_env(submit)["env_vars"]["VERL_USE_EXTERNAL_MODULES"] == expected


def test_ray_submit_carries_the_launchers_own_knobs(fake_bin, tmp_path):
    # Knobs the local launcher reads beyond the shared list (e.g. MESH) reach the job when set;
    # PYTHON (a path on the submitting host) and unset knobs do not.
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "run_deepseek_v4_flash_ppo_megatron.sh").write_text(
        '#!/usr/bin/env bash\nMESH=${MESH:-h200_64gpu}\nROLLOUT_QUANT=${ROLLOUT_QUANT:-}\nOFFLOAD=${OFFLOAD-true}\n'
        'PYTHON=${PYTHON:-python3}\nlocal_var=1\n'
    )
    out = _run("scripts/ray_cluster.sh", "--dry-run", "submit", "ppo", fake_bin=fake_bin,
               env={"RAY_WORKING_DIR": str(tmp_path), "MESH": "gb200_40gpu", "OFFLOAD": "false", "NNODES": "4"})
    assert out.returncode == 0, out.stderr
    [submit] = _find(_commands(out.stdout), "ray", "job", "submit")
    runtime_env = _runtime_env(submit)
    assert runtime_env["working_dir"] == str(tmp_path)
    env_vars = runtime_env["env_vars"]
    assert env_vars["MESH"] == "gb200_40gpu" and env_vars["OFFLOAD"] == "false" and env_vars["NNODES"] == "4"
    assert "ROLLOUT_QUANT" not in env_vars and "PYTHON" not in env_vars


def test_ray_submit_passes_recipe_flags_after_double_dash(fake_bin):
    out = _run("scripts/ray_cluster.sh", "submit", "ppo", "--dry-run", "x=1", "--", "--dry-run", "y=2",
               fake_bin=fake_bin)
    assert out.returncode == 0, out.stderr
    _assert_nothing_ran(fake_bin)
    [submit] = _find(_commands(out.stdout), "ray", "job", "submit")
    assert submit[submit.index("--") + 1:] == ["bash", "scripts/run_deepseek_v4_flash_ppo_megatron.sh", "x=1",
                                               "--dry-run", "y=2"]


def test_ray_node_commands_dry_run(fake_bin):
    env = {"RAY_HEAD_IP": "10.0.0.1", "GPUS_PER_NODE": "4", "NNODES": "3"}
    head = _run("scripts/ray_cluster.sh", "--dry-run", "start-head", "--block", fake_bin=fake_bin, env=env)
    worker = _run("scripts/ray_cluster.sh", "--dry-run", "start-worker", fake_bin=fake_bin, env=env)
    wait = _run("scripts/ray_cluster.sh", "--dry-run", "wait-nodes", fake_bin=fake_bin, env=env)
    stop = _run("scripts/ray_cluster.sh", "--dry-run", "stop", fake_bin=fake_bin, env=env)
    stop_all = _run("scripts/ray_cluster.sh", "--dry-run", "stop", "--all", fake_bin=fake_bin, env=env)
    assert all(p.returncode == 0 for p in (head, worker, wait, stop, stop_all))
    _assert_nothing_ran(fake_bin)
    [h] = _commands(head.stdout)
    assert h[:3] == ["ray", "start", "--head"] and "--num-gpus=4" in h and "--block" in h
    assert "--node-ip-address=10.0.0.1" in h and "--dashboard-host=0.0.0.0" in h
    # Without --block the script owns the node: `ray start --block` in the background under a PID file.
    assert _commands(worker.stdout) == [["ray", "start", "--address=10.0.0.1:6379", "--num-gpus=4", "--block"]]
    assert worker.stdout.rstrip().endswith("&") and "/tmp/verl-ds4-ray/worker/ray_start.log" in worker.stdout
    [w] = _commands(wait.stdout)
    assert w[1:] == ["scripts/ray_wait_nodes.py", "--nodes", "3", "--timeout", "600", "--address", "10.0.0.1:6379"]
    # `stop` stops the nodes this script started, by PID; `ray stop` (every Ray on the host) only with --all.
    assert [c[:2] for c in _commands(stop.stdout)] == [["kill", "-TERM"], ["kill", "-TERM"]]
    assert "/tmp/verl-ds4-ray/head/ray_start.pid" in stop.stdout
    assert _commands(stop_all.stdout) == [["ray", "stop"]]


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["start-worker"], {}, "RAY_HEAD_IP"),
        (["submit", "sft"], {}, "torchrun, not Ray"),
        (["submit"], {}, "needs a recipe"),
        (["submit", "dpo"], {}, "unknown RL recipe 'dpo'"),
        (["start-head"], {"GPUS_PER_NODE": "eight"}, "GPUS_PER_NODE must be a positive integer"),
        (["wait-nodes"], {"NNODES": "0"}, "NNODES must be a positive integer"),
        (["bogus"], {}, "unknown command 'bogus'"),
        (["submit", "ppo"], {"EXTRA_ENV_VARS": "HF_HOME bad-name"}, "'bad-name' is not an env variable name"),
    ],
)
def test_ray_cluster_rejects_bad_input(args, env, message, fake_bin):
    out = _run("scripts/ray_cluster.sh", "--dry-run", *args, fake_bin=fake_bin, env=env)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    _assert_nothing_ran(fake_bin)


def test_ray_submit_without_launcher_fails_clearly_when_not_dry(fake_bin, tmp_path):
    # A working_dir without the recipe's local launcher: refused before anything is submitted.
    out = _run("scripts/ray_cluster.sh", "submit", "ppo", fake_bin=fake_bin, env={"RAY_WORKING_DIR": str(tmp_path)})
    assert out.returncode == 2 and "local launcher" in out.stderr
    _assert_nothing_ran(fake_bin)


def test_slurm_ppo_4_nodes_dry_run(fake_bin):
    out = _run("scripts/slurm_submit.sh", "--dry-run", "ppo", "trainer.total_epochs=1", fake_bin=fake_bin,
               env={k: v for k, v in PPO_4_NODES.items() if k != "RAY_HEAD_IP"})
    assert out.returncode == 0, out.stderr
    _assert_nothing_ran(fake_bin)
    cmds = _commands(out.stdout)
    [sbatch] = _find(cmds, "sbatch")
    assert {"--nodes=4", "--gpus-per-node=8", "--ntasks-per-node=1", "--export=ALL"} <= set(sbatch)
    assert sbatch[-4:] == ["scripts/slurm_ray_rl.sbatch", "ppo", "--", "trainer.total_epochs=1"]
    sruns = _find(cmds, "srun")
    head = [c for c in sruns if c[-3:] == ["scripts/ray_cluster.sh", "start-head", "--block"]]
    workers = [c for c in sruns if c[-3:] == ["scripts/ray_cluster.sh", "start-worker", "--block"]]
    assert len(head) == 1 and "-w" in head[0] and head[0][head[0].index("-w") + 1] == "node1"
    assert len(workers) == 1 and "--nodes=3" in workers[0] and "--exclude=node1" in workers[0]
    # The nested expansion shows the Ray commands and the job submission with the 4-node knobs.
    [start_head] = _find(cmds, "ray", "start", "--head")
    assert "--node-ip-address=IP_OF_node1" in start_head
    assert _find(cmds, "ray", "start", "--address=IP_OF_node1:6379", "--num-gpus=8", "--block")
    [submit] = _find(cmds, "ray", "job", "submit")
    assert "--address=http://IP_OF_node1:8265" in submit
    assert _runtime_env(submit)["env_vars"]["NNODES"] == "4"
    assert submit[submit.index("--") + 1:] == ["bash", "scripts/run_deepseek_v4_flash_ppo_megatron.sh",
                                               "trainer.total_epochs=1"]
    order = [i for i, c in enumerate(cmds) if c[:1] == ["srun"]]
    assert "wait-nodes" in cmds[order[-2]] and "submit" in cmds[order[-1]]


def test_slurm_sft_dry_run_in_a_container(fake_bin):
    env = {"NNODES": "4", "GPUS_PER_NODE": "8", "MODEL_PATH": "/ckpt/DeepSeek-V4-Flash",
           "CONTAINER_IMAGE": "registry.example.com/verl-ds4:0.1.0", "CONTAINER_MOUNTS": "/data:/data"}
    out = _run("scripts/slurm_submit.sh", "--dry-run", "sft", "data.max_length=8192", fake_bin=fake_bin, env=env)
    assert out.returncode == 0, out.stderr
    _assert_nothing_ran(fake_bin)
    cmds = _commands(out.stdout)
    [sbatch] = _find(cmds, "sbatch")
    assert "--nodes=4" in sbatch and sbatch[-3:] == ["scripts/slurm_sft.sbatch", "--", "data.max_length=8192"]
    exports = dict(c[1].split("=", 1) for c in _find(cmds, "export"))
    assert exports["PET_NNODES"] == "4" and exports["PET_NPROC_PER_NODE"] == "8"
    assert exports["PET_MASTER_ADDR"] == exports["MASTER_ADDR"] == "node1"
    assert "--signal=B:USR1@300" in sbatch and "--requeue" in sbatch
    srun = _supervised_srun(cmds)
    assert "--nodes=4" in srun and "--ntasks-per-node=1" in srun
    assert "--container-image=registry.example.com/verl-ds4:0.1.0" in srun
    assert "--container-mounts=/data:/data" in srun and "--container-workdir=/opt/verl-ds4" in srun
    inner = srun[srun.index("bash"):]
    assert inner[1] == "-c" and "PET_NODE_RANK=$SLURM_NODEID" in inner[2]
    assert inner[3:] == ["scripts/run_deepseek_v4_flash_sft_megatron.sh", "data.max_length=8192"]


def test_sbatch_scripts_refuse_a_mismatched_allocation(fake_bin):
    out = _run("scripts/slurm_sft.sbatch", "--dry-run", fake_bin=fake_bin,
               env={"NNODES": "4", "SLURM_JOB_NUM_NODES": "2"})
    assert out.returncode == 2 and "NNODES=4 but the Slurm allocation has 2 nodes" in out.stderr
    out = _run("scripts/slurm_ray_rl.sbatch", "--dry-run", fake_bin=fake_bin)
    assert out.returncode == 2 and "ppo or grpo" in out.stderr
    out = _run("scripts/slurm_submit.sh", "--dry-run", "dpo", fake_bin=fake_bin)
    assert out.returncode == 2 and "unknown recipe 'dpo'" in out.stderr
    _assert_nothing_ran(fake_bin)


def test_sbatch_single_node_rl_starts_no_workers(fake_bin):
    out = _run("scripts/slurm_ray_rl.sbatch", "--dry-run", "grpo", fake_bin=fake_bin, env={"NNODES": "1"})
    assert out.returncode == 0, out.stderr
    cmds = _commands(out.stdout)
    assert not [c for c in cmds if "start-worker" in c]
    [submit] = _find(cmds, "ray", "job", "submit")
    assert submit[-1] == "scripts/run_deepseek_v4_flash_grpo_megatron.sh"


@pytest.mark.parametrize("script", ["scripts/ray_cluster.sh", "scripts/slurm_submit.sh", "scripts/slurm_sft.sbatch",
                                    "scripts/slurm_ray_rl.sbatch"])
def test_launchers_have_help(script, fake_bin):
    out = _run(script, "--help", fake_bin=fake_bin)
    assert out.returncode == 0 and "--dry-run" in out.stdout
    _assert_nothing_ran(fake_bin)


def test_ray_wait_nodes_waits_and_times_out(monkeypatch, capsys):
    # A stand-in `ray` module (starting a real cluster here would touch other users' Ray processes):
    # the node list grows from 1 to 3 alive nodes over successive polls.
    import types

    polls = {"n": 0}
    fake_ray = types.ModuleType("ray")
    fake_ray.init = lambda address, logging_level: polls.setdefault("address", address)

    def nodes():
        polls["n"] += 1
        return [{"Alive": True}] * min(polls["n"], 3) + [{"Alive": False}]

    fake_ray.nodes = nodes
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    spec = importlib.util.spec_from_file_location("ray_wait_nodes", REPO / "scripts" / "ray_wait_nodes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    assert module.main(["--nodes", "3", "--timeout", "5", "--poll", "0", "--address", "10.0.0.1:6379"]) == 0
    assert polls["address"] == "10.0.0.1:6379" and polls["n"] == 3
    assert "3 of 3 nodes alive" in capsys.readouterr().out
    assert module.main(["--nodes", "4", "--timeout", "0", "--poll", "0"]) == 1
    assert "only 3 of 4 nodes alive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        module.main(["--nodes", "0"])


def test_cpu_switch_changes_device_launcher_and_process_counts_only(fake_bin):
    # DS4_DEVICE=cpu: no GPU request (0 overrides the script's #SBATCH --gpus-per-node=8), the CPU job's launcher,
    # NPROC_PER_NODE processes per node (1 each on 2 nodes); the rendezvous is built as on GPUs.
    out = _run("scripts/slurm_submit.sh", "--dry-run", "sft", "trainer.save_freq=2", fake_bin=fake_bin,
               env={"DS4_DEVICE": "cpu", "NNODES": "2"})
    assert out.returncode == 0, out.stderr
    _assert_nothing_ran(fake_bin)
    cmds = _commands(out.stdout)
    [sbatch] = _find(cmds, "sbatch")
    assert "--gpus-per-node=0" in sbatch and "--nodes=2" in sbatch
    exports = dict(c[1].split("=", 1) for c in _find(cmds, "export"))
    assert exports["PET_NNODES"] == "2" and exports["PET_NPROC_PER_NODE"] == "1" and exports["NPROC"] == "1"
    assert exports["PET_MASTER_ADDR"] == "node1"
    srun = _supervised_srun(cmds)
    assert srun[srun.index("bash") + 3:] == ["scripts/run_ds4_proxy_sft_cpu.sh", "trainer.save_freq=2"]
    assert "[verl-ds4] processes   1 per node, world size 2" in out.stdout
    # The same without the switch: the GPU launcher and its GPUs (and a GPU job's knobs are not checked in a dry run).
    gpu = _run("scripts/slurm_submit.sh", "--dry-run", "sft", fake_bin=fake_bin, env={"NNODES": "2"})
    [sbatch] = _find(_commands(gpu.stdout), "sbatch")
    assert "--gpus-per-node=8" in sbatch and "PET_NPROC_PER_NODE=8" in gpu.stdout
    assert "scripts/run_deepseek_v4_flash_sft_megatron.sh" in gpu.stdout


@pytest.mark.parametrize(
    "script, args, env, message",
    [
        ("scripts/slurm_submit.sh", ["sft"], {"DS4_DEVICE": "tpu"}, "DS4_DEVICE=tpu: expected gpu"),
        ("scripts/slurm_submit.sh", ["sft"], {"DS4_DEVICE": "cpu", "NPROC_PER_NODE": "two"},
         "NPROC_PER_NODE must be a positive integer"),
        ("scripts/slurm_submit.sh", ["sft"], {"NPROC_PER_NODE": "4", "GPUS_PER_NODE": "8"},
         "NPROC_PER_NODE=4 but GPUS_PER_NODE=8"),
        ("scripts/slurm_submit.sh", ["sft"], {}, "MODEL_PATH is not set"),
        ("scripts/ray_cluster.sh", ["submit", "ppo"], {"DS4_DEVICE": "cpu", "WORK_DIR": "runs/x"},
         "needs an absolute WORK_DIR"),
        ("scripts/ray_cluster.sh", ["start-head"], {"RAY_NODE_PORTS": "some"}, "RAY_NODE_PORTS=some: expected auto"),
        ("scripts/ray_cluster.sh", ["stop", "now"], {}, "stop takes no arguments but --all"),
    ],
)
def test_cluster_launchers_refuse_bad_knobs_before_submitting(script, args, env, message, fake_bin):
    out = _run(script, *args, fake_bin=fake_bin, env=env)  # not a dry run: a real submission is refused
    assert out.returncode == 2 and message in out.stderr, out.stderr
    _assert_nothing_ran(fake_bin)
