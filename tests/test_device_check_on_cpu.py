"""The device check (benchmarks/gpu/device_check.sh) stays runnable: its Python parts on the CPU.

The script itself runs on a GPU machine without Megatron or verl; here its --help, its argument
checks, the DS4 attention check (device=cpu, quick sizes) and the no-verl/megatron import rule, and the
whole-model checks of DS4 and V4.1 (``--checks ds4,ds41 --quick``: one PASS line per model; they may
import Megatron-Core, carried as a wheel, and nothing of verl / Ray).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu" / "device_check.sh"


def _load():
    spec = importlib.util.spec_from_file_location("device_checks", REPO / "benchmarks" / "gpu" / "device_checks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_help_and_bad_arguments():
    out = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--out DIR" in out.stdout and "results.txt" in out.stdout
    bad = subprocess.run(["bash", str(SCRIPT), "--device", "tpu"], capture_output=True, text=True)
    assert bad.returncode == 2 and "cuda or cpu" in bad.stderr
    py = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu" / "device_checks.py"), "--help"],
                        capture_output=True, text=True)
    assert py.returncode == 0 and "attention" in py.stdout


def test_attention_check_passes_on_cpu_and_imports_no_verl_or_megatron(tmp_path):
    # A fresh interpreter: what the check imports is what the device machine must have.
    results = tmp_path / "results.txt"
    code = (
        "import sys, runpy; sys.argv = ['device_checks', '--device', 'cpu', '--quick', '--checks', 'attention,memory',"
        " '--results', sys.argv[1]];"
        f"runpy.run_path({str(REPO / 'benchmarks' / 'gpu' / 'device_checks.py')!r}, run_name='__main__')"
    )
    out = subprocess.run([sys.executable, "-c", code, str(results)], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = results.read_text().splitlines()
    assert len(lines) == 4 and all(line.startswith("PASS attention") for line in lines[:3]), lines
    # the memory calibration: the pure-PyTorch DS4 it builds has exactly the closed form's parameters
    assert lines[3].startswith("PASS memory calibration on cpu: 2 layers, hidden 32, 4 experts, 64 tokens"), lines[3]
    assert re.search(r"params built ([0-9,]+) vs model \1;", lines[3]) and "= 1.00" in lines[3]
    assert "FAIL imports" not in out.stdout


def test_a_wrong_result_fails(monkeypatch):
    dc = _load()
    monkeypatch.setitem(dc.TOLERANCE, "float32", (0.0, 0.0))  # nothing is exact: must FAIL
    result = dc.attention_case("swa", "float32", "cpu", topk=40, lengths=[5, 13])
    assert not result.ok and result.line().startswith("FAIL attention swa float32")


def test_a_wrong_memory_model_fails_the_calibration(monkeypatch):
    sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
    import dataclasses

    import memory_calibration as mc

    real = mc.model_sizes
    # the model counting one expert too many per layer: the states no longer agree (negative control)
    monkeypatch.setattr(mc, "model_sizes", lambda shape: real(dataclasses.replace(shape, n_routed_experts=shape.n_routed_experts + 1)))
    name, ok, detail = mc.summary(mc.calibrate("cpu", quick=True))
    assert not ok and "params built 25,915 vs model" in detail


def test_the_import_rule_sees_a_forbidden_module(monkeypatch):
    dc = _load()
    # this pytest process may have imported verl / megatron in earlier tests: start from none of them
    for name in [m for m in sys.modules if m.split(".")[0] in dc.FORBIDDEN_IMPORTS]:
        monkeypatch.delitem(sys.modules, name)
    assert dc.forbidden_modules_loaded() == []
    monkeypatch.setitem(sys.modules, "megatron", type(sys)("megatron"))
    assert dc.forbidden_modules_loaded() == ["megatron"]


@pytest.mark.extended  # CI: the attention check above runs the same script on the CPU
def test_whole_model_checks_pass_on_cpu_one_line_per_model(tmp_path):
    results = tmp_path / "results.txt"
    code = (
        "import sys, runpy; sys.argv = ['device_checks', '--device', 'cpu', '--quick', '--checks', 'ds4,ds41',"
        " '--results', sys.argv[1]];"
        f"runpy.run_path({str(REPO / 'benchmarks' / 'gpu' / 'device_checks.py')!r}, run_name='__main__')"
    )
    out = subprocess.run([sys.executable, "-c", code, str(results)], capture_output=True, text=True, cwd=REPO, timeout=600)
    lines = results.read_text().splitlines()
    print("\n".join(lines))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert [line.split(":")[0] for line in lines] == ["PASS ds4 whole model on cpu", "PASS ds41 whole model on cpu"], lines
    for line in lines:
        assert "float32: " in line and "bfloat16: " in line and "routes replayed" in line and "routes native, 0 of " in line
    assert "FAIL imports" not in out.stdout


def test_a_model_check_row_over_its_tolerance_fails():
    sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
    _load()
    import model_checks

    from verl_ds4.verify.parity import Row

    rows = [Row("fp32 ragged loss", 1e-7, 1e-7, 1e-3), Row("fp32 ragged grads mtp (3 params)", 1e-6, 2e-6, 1e-3)]
    assert model_checks._summary(rows, 1e-3)[0]
    rows.append(Row("fp32 ragged grads experts (4 params)", 0.1, 0.5, 1e-3))  # negative control: one bad group
    ok, detail = model_checks._summary(rows, 1e-3)
    assert not ok and "worst gradient group: grads experts 5.0e-01" in detail
