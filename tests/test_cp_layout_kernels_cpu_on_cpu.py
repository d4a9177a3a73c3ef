"""verl_ds4.substitutes.cp_layout_kernels (the CPU stand-ins of the CuTe-DSL kernels that Megatron-LM dev's DS4
attention calls under CP > 1) against the pure-PyTorch references of Megatron's own test file, at the pinned commit
(every proven commit in the extended proofs, ``bash benchmarks/extended_proofs.sh``).

tests/megatron_dev_cp_kernels.py runs in a subprocess per commit (it imports dev's ``megatron/core`` in place of the
installed megatron-core) and prints what differs; the commits run at once. Integer outputs must be equal, float outputs
and gradients equal to 0.0 at float64 (the bound is 1e-12) and at bfloat16 (a copy rounds nothing). Skipped only
where no export can be found; with CI=true and the archives beside the repository it must run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_ds4.substitutes import megatron_dev
from verl_ds4.testing import extended

REPO = Path(__file__).resolve().parents[1]
# CI compares at the pin; the extended proofs (bash benchmarks/extended_proofs.sh) at every proven commit.
COMMITS = extended.proven_commits()
MODES = ("all_visible_production_map", "selected_production_map", "indexer_loss_production_map",
         "selected_noisy_map", "indexer_loss_noisy_map")

_missing = [c for c in COMMITS if not megatron_dev.available(c)]
if _missing and os.environ.get("CI") == "true" and megatron_dev.ARCHIVE_DIR.is_dir():
    raise RuntimeError(f"CI has {megatron_dev.ARCHIVE_DIR} but no export of {', '.join(c[:12] for c in _missing)}: "
                       "the comparison with Megatron's references must not be skipped there")
pytestmark = pytest.mark.skipif(
    bool(_missing), reason=f"no Megatron-LM dev export of {', '.join(c[:12] for c in _missing)}: "
    f"{megatron_dev.make_command(_missing[0]) if _missing else ''}")


@pytest.fixture(scope="module")
def results():
    trees = {c: megatron_dev.find(c) for c in COMMITS}  # unpack here, once, before the subprocesses start
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    runs = {c: subprocess.Popen([sys.executable, str(REPO / "tests" / "megatron_dev_cp_kernels.py"), c],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
            for c in COMMITS}
    out = {}
    for commit, proc in runs.items():
        stdout, stderr = proc.communicate(timeout=300)
        lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, stderr[-3000:]
        result = json.loads(lines[-1][len("RESULT "):])
        result["tree"] = str(trees[commit].root)
        out[commit] = result
    return out


@pytest.fixture(params=extended.commit_params(COMMITS), ids=lambda c: c[:8])
def result(request, results):
    return results[request.param]


def test_the_comparison_imports_megatron_dev_and_its_references(result):
    root = Path(result["tree"]).resolve()
    assert root in Path(result["kernels_file"]).resolve().parents
    assert Path(result["references_file"]).resolve() == (root / "tests" / "unit_tests" / "transformer" /
                                                          "experimental_attention_variant" /
                                                          "test_csa_cp_layout_kernels.py")
    assert result["commit"] in COMMITS


def test_install_patches_the_module_attributes_csa_and_cp_utils_call(result):
    patch = result["patch"]
    module = "megatron.core.transformer.experimental_attention_variant.csa_utils.cp_layout_kernels"
    assert patch["installed_names"] == [f"{module}.CompressorInputCompact", f"{module}.build_attention_indices"]
    assert patch["installed_again"] == patch["installed_names"]
    assert patch["csa_calls_ours"] and patch["cp_utils_calls_ours"] and result["restored"]
    assert "require CUDA tensors" in patch["original_raises_on_cpu"]  # what the patch is for
    # Megatron's own padded-row example: one in-range dummy key, length 1
    assert result["megatron_example"] == {"padded_rows": [[0, -1], [0, -1]], "padded_lengths": [1, 1]}


def test_compressor_input_compact_equals_the_reference(result):
    """Every CP 2 / 4 rank of random layouts at ratio 4 and 128: compact rows, group ids and both gradients, at
    float64 and bfloat16; and dev's own prepare_cp_compressor_input on CPU, through the patch."""
    cases = {k: v for k, v in result["cases"].items() if "ratio0" not in k}
    assert len(cases) == 24
    for key, case in cases.items():
        for dtype in ("float64",) + (("bfloat16",) if "layout0" in key else ()):
            assert case[f"ids_{dtype}"] == 0 and case[f"dtype_kept_{dtype}"] == 1, (key, case)
            assert max(case[f"{k}_{dtype}"] for k in ("compact", "grad_local", "grad_boundary")) <= 1e-12, (key, case)
        assert case["prepare_cp_compressor_input"] == 0, (key, case)
    groups = [case["groups_float64"] for case in cases.values()]
    assert all(groups) and sum(groups) >= 80  # every rank compacts at least one group


def test_build_attention_indices_equals_the_reference(result):
    """All three index modes with the production map (ratio 4, 128; window-only: every-visible mode), and the
    selected / indexer-loss modes with a random map holding invalid rows: equal entry for entry."""
    cases = result["cases"]
    assert len(cases) == 36 and result["rows"] > 5000
    for key, case in cases.items():
        modes = MODES if "ratio0" not in key else MODES[:1]
        assert all(case[m] == 0 for m in modes), (key, case)


def test_negative_control_an_off_by_one_rank_offset_is_detected(result):
    """The same functions with global_start + 1: every case differs from the reference."""
    control = result["control"]
    assert len(control) == 36 + 24
    assert all(v > 0 for v in control.values()), {k: v for k, v in control.items() if not v > 0}


def test_every_visible_mode_with_an_invalid_map_row_keeps_the_kernels_holes(result):
    """Where ``seq_to_rank_row`` is -1 for a visible compressed row (never with the production map: its -1 rows are
    past the last real compressed row), Megatron's CUDA kernel leaves -1 in that column and counts it in
    ``topk_length``, while the reference of its test file packs the valid ids. The stand-in follows the kernel, so
    it differs from the reference here: an upstream divergence, pinned so that a change on either side shows."""
    assert any(v > 0 for v in result["mode1_invalid_map"].values())
