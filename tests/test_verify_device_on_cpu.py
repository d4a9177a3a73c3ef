"""``verl-ds4 verify --device``: the device path of the CP parity check (verl_ds4/verify/device_run.py).

* Bad input, refused before any model is built: ``--device cuda`` without a GPU (exit 2, the torch
  build named), ``--cp`` above the visible GPU count (exit 2, the count named), ``--dtype bf16`` on the
  CPU, ``--model ds41`` on cuda.
* The device path itself runs on the CPU here (``run_against_fp64(device="cpu")``: the same code with
  gloo ranks): fp32 and bf16 against the fp64 reference pass, routing notes say native / replayed;
  negative control: fp32 is really fp32 (its rows fail a 1e-12 tolerance).
* Route tapes: a shifted route is counted as a difference (negative control of the count).
* verify runs without verl: the tiny DS4 vocabulary is recorded (checked against the tokenizer), and
  the verify path imports no verl / Ray (negative control: the tokenizer does import verl).
* On a GPU (skipped without one): ``verify --device cuda --cp 1`` passes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"ragged": (5, 60, 23)}


def _args(*argv):
    from verl_ds4.verify import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli, parser.parse_args(list(argv))


@pytest.fixture
def no_models(monkeypatch):
    """Any attempt to run a parity step fails the test (refusals must come first)."""
    from verl_ds4.verify import parity

    def boom(*a, **k):
        raise AssertionError("a model was built before the refusal")

    monkeypatch.setattr(parity, "run_parity", boom)


def test_cuda_without_a_gpu_exits_2_before_any_model(monkeypatch, capsys, no_models):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cli, args = _args("--device", "cuda", "--cp", "1")
    assert cli.run(args) == 2
    err = capsys.readouterr().err
    assert "--device cuda: no CUDA GPU is visible" in err and "use --device cpu" in err


def test_cp_above_the_gpu_count_is_refused_with_the_count(monkeypatch, capsys, no_models):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cli, args = _args("--device", "cuda", "--cp", "4")
    assert cli.run(args) == 2
    assert "--device cuda --cp 4: 2 CUDA GPU(s) visible" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (("--cp", "2", "--dtype", "bf16"), "--dtype bf16 runs on --device cuda only"),
    (("--device", "cuda", "--model", "ds41", "--cp", "2"), "--device cuda runs the CP parity of --model ds4"),
    (("--device", "cuda"), "--device cuda needs --cp N >= 1"),
])  # fmt: skip
def test_device_refusals(argv, message, capsys, no_models):
    cli, args = _args(*argv)
    assert cli.run(args) == 2
    assert message in capsys.readouterr().err


def test_the_device_path_against_fp64_on_cpu():
    from verl_ds4.verify.device_run import run_against_fp64
    from verl_ds4.verify.parity import rows_passed

    rows, notes, _ = run_against_fp64(1, device="cpu", dtypes=("fp32", "bf16"), layout_checks=False, batches=SMALL)
    assert rows_passed(rows), [(r.quantity, r.max_rel) for r in rows if not r.passed]
    fp32 = [r for r in rows if r.quantity.startswith("fp32")]
    bf16 = [r for r in rows if r.quantity.startswith("bf16")]
    assert len(fp32) == len(bf16) >= 15
    # Negative control: the fp32 rows are not fp64 in disguise (they fail a 1e-12 tolerance) ...
    assert max(r.max_rel for r in fp32) > 1e-12
    # ... and bf16 is coarser than fp32.
    assert max(r.max_rel for r in bf16) > 100 * max(r.max_rel for r in fp32)
    assert any(n.startswith("routing fp32 ragged: native; 0 of ") for n in notes), notes
    assert any(n.startswith("routing bf16 ragged: replayed from the fp64 reference") for n in notes), notes


def test_route_differences_are_counted():
    from verl_ds4.verify.routes import count_differences

    ref = {"r": {"native": np.array([[0, 1], [2, 3], [1, 0]])}}
    assert count_differences({"r": {"native": np.array([[1, 0], [3, 2], [0, 1]])}}, ref) == (0, 3)  # order ignored
    assert count_differences({"r": {"native": np.array([[0, 2], [2, 3], [1, 0]])}}, ref) == (1, 3)  # negative control


def test_tiny_vocabulary_record_matches_the_tokenizer():
    from verl_ds4.cpu.sft_data import padded_vocab_size, tokenizer_size
    from verl_ds4.verify.parity import TINY_VOCAB_SIZE

    assert TINY_VOCAB_SIZE == padded_vocab_size(tokenizer_size())


def _loaded_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return set(out.stdout.split())


def test_verify_path_imports_no_verl():
    loaded = _loaded_after("from verl_ds4.verify import cli, device_run, parity, routes; from verl_ds4.models.ds4 import model; "
                           "parity._Models('ds4', None, 1)")
    assert "megatron" in loaded and not loaded & {"verl", "ray"}
    # Negative control: the CPU jobs' tokenizer does pull verl (what the recorded vocabulary avoids).
    assert "verl" in _loaded_after("from verl_ds4.cpu.sft_data import tokenizer_size; tokenizer_size()")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_verify_on_one_gpu(capsys):
    cli, args = _args("--device", "cuda", "--cp", "1")
    assert cli.run(args) == 0, capsys.readouterr().out
