"""benchmarks/gpu/megatron_dsv4_memory.py (Megatron-LM dev's own DS4 layers, measured on a GPU) stays
runnable: its argument checks, its Hadamard stand-in, the export script, and, where the git-ignored
Megatron dev export exists (never in CI), one tiny CPU case end to end."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from verl_ds4.testing.megatron_dev_export import export_mark, tree
import torch

REPO = Path(__file__).resolve().parents[1]
GPU = REPO / "benchmarks" / "gpu"
SCRIPT = GPU / "megatron_dsv4_memory.py"
PREPARE = GPU / "prepare_megatron_dev.sh"


def _load():
    spec = importlib.util.spec_from_file_location("megatron_dsv4_memory", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_arguments_are_checked():
    m = _load()
    args = m.parse_args(["--device", "cpu", "--quick", "--kinds", "hca", "--recompute", "selective"])
    assert (args.kinds, args.recompute, args.tokens) == (["hca"], ["selective"], [256, 512])
    with pytest.raises(SystemExit):  # an unknown kind is refused (the control above passes)
        m.parse_args(["--device", "cpu", "--kinds", "csa,mla"])
    bad = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--recompute", "full"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--recompute: unknown ['full']" in bad.stderr


def test_a_missing_megatron_export_is_named(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--megatron", str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "run benchmarks/gpu/prepare_megatron_dev.sh first" in out.stderr


def test_the_hadamard_stand_in_is_an_orthogonal_map_with_its_own_backward():
    m = _load()
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    y = m._Hadamard.apply(x, 8 ** -0.5)
    assert torch.allclose(m._Hadamard.apply(y, 8 ** -0.5), x)  # H H / n = I
    assert torch.autograd.gradcheck(lambda t: m._Hadamard.apply(t, 0.3), (x,))
    h = m._Hadamard.matrix(4, torch.float64, "cpu")
    assert h.tolist()[3] == [1, -1, -1, 1]
    with pytest.raises(ValueError, match="power-of-two width, got 6"):
        m._Hadamard.matrix(6, torch.float64, "cpu")


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_the_export_script_exports_a_commit_and_refuses_an_unknown_one(tmp_path):
    src = tmp_path / "src"
    (src / "megatron" / "core").mkdir(parents=True)
    (src / "megatron" / "core" / "__init__.py").write_text("X = 1\n")
    (src / "megatron" / "training.py").write_text("")
    _git(src, "init", "-q")
    _git(src, "-c", "user.email=a@b", "-c", "user.name=t", "add", ".")
    _git(src, "-c", "user.email=a@b", "-c", "user.name=t", "commit", "-qm", "x")
    dest = tmp_path / "dest"
    env = {"PATH": "/usr/bin:/bin", "MEGATRON_DEV_DEST": str(dest)}
    ok = subprocess.run(["bash", str(PREPARE), str(src / ".git"), "HEAD"], capture_output=True, text=True, env=env)
    assert ok.returncode == 0, ok.stderr
    assert (dest / "megatron" / "core" / "__init__.py").read_text() == "X = 1\n"
    assert not (dest / "megatron" / "training.py").exists() and len((dest / "COMMIT").read_text().strip()) == 40
    bad = subprocess.run(["bash", str(PREPARE), str(src / ".git"), "0" * 40], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "is not in the git directory" in bad.stderr


@export_mark()
def test_one_tiny_case_runs_on_cpu(tmp_path):
    out = tmp_path / "m.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--kinds", "csa",
                          "--recompute", "none", "--tokens", "256", "--out", str(out), "--megatron", str(tree().root)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert row["kind"] == "csa" and not row["oom"] and row["saved"] > 0 and row["kept"] is None
    # Megatron's own unfused backward allocates [T, T + T/4, head_dim] bf16 in gather_backward: the
    # profiler's largest such block is exactly the figure read from the code (not T x T x head_dim)
    t, d = 256, data["info"]["widths"]["head_dim"]
    assert row["cpu_gather_bwd_allocs"][0] == row["gather_bwd"] == t * (t + t // 4) * d * 2 != t * t * d * 2
    assert data["info"]["hadamard"].startswith(("fast_hadamard_transform", "pure-PyTorch"))


@export_mark()
def test_the_linear_core_runs_in_megatrons_own_layers(tmp_path):
    """--attention megatron,linear: the same CSA layer with dev's unfused core, then with verl-ds4's linear core
    installed (dense indexer loss on): the linear rows allocate no gather backward and save less."""
    out = tmp_path / "m.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--kinds", "csa", "--recompute", "none",
                          "--tokens", "256", "--attention", "megatron,linear", "--indexer-loss-coeff", "0.1",
                          "--out", str(out), "--megatron", str(tree().root)], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    data = json.loads(out.read_text())
    rows = {r["attention"]: r for r in data["rows"]}
    assert set(rows) == {"megatron", "linear"} and data["info"]["linear_core"] == [
        "FusedDSAIndexerLoss", "_unfused_indexer_sparse_attn_from_topk", "fused_qk_topk_naive", "unfused_compressed_sparse_attn"]
    assert rows["megatron"]["cpu_gather_bwd_allocs"] and not rows["linear"]["cpu_gather_bwd_allocs"]  # control: dev's has it
    assert 0 < rows["linear"]["saved"] < rows["megatron"]["saved"]
