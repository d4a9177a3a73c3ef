"""verl-ds4's linear sparse attention against Megatron-LM dev's own functions, where the Megatron dev export exists.

Compares (tests/megatron_dev_sparse_attn.py, in a subprocess that imports Megatron-LM ``dev``'s ``megatron/core``
from the tree ``benchmarks/gpu/prepare_megatron_dev.sh`` exports): ``csa.unfused_compressed_sparse_attn``,
``csa.fused_qk_topk_naive``, ``csa._unfused_indexer_sparse_attn_from_topk`` and ``csa.FusedDSAIndexerLoss`` (CP 1)
with their replacements, forward
and backward, and installs / checks / uninstalls the patch (a changed Megatron function is refused). Skipped
only where no export can be found (a user's machine: the reason names the command that makes one); in CI the archives
of ``../shared/third_party/megatron-lm-dev`` are unpacked and the pinned commit runs (every proven commit in the
extended proofs, ``bash benchmarks/extended_proofs.sh``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from verl_ds4.substitutes import megatron_dev
from verl_ds4.testing import extended
from verl_ds4.testing.megatron_dev_export import export_mark, tree

REPO = Path(__file__).resolve().parents[1]
# CI runs at the pin; the extended proofs (bash benchmarks/extended_proofs.sh) at every proven commit.
COMMITS = extended.proven_commits()

pytestmark = export_mark(*COMMITS)


@pytest.fixture(scope="module", params=extended.commit_params(COMMITS), ids=lambda c: c[:8])
def result(request):
    export = tree(request.param).root
    out = subprocess.run([sys.executable, str(REPO / "tests" / "megatron_dev_sparse_attn.py"), str(export)],
                         capture_output=True, text=True, timeout=300, cwd=REPO)  # fmt: skip
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    data = json.loads(lines[-1][len("RESULT ") :])
    data["export"] = str(export)
    return data


def test_the_comparison_imports_megatron_dev(result):
    csa = Path(result["export"]) / "megatron" / "core" / "transformer" / "experimental_attention_variant" / "csa.py"
    assert Path(result["megatron_file"]).resolve() == csa.resolve()


def test_unfused_compressed_sparse_attn(result):
    """Megatron's own code in float64 vs the core in float64: <= 1e-12 (the proof that they compute the same function);
    float32 as Megatron runs it: <= 1e-4, a rounding bound (max over the output and the gradients of q, kv and the
    sink, relative to each one's largest entry; the sink's gradient sums every row and head: usually 1.8e-6 here, one
    full-suite run on the loaded 2-core machine gave 4.0e-5 for every chunk size alike, which did not recur)."""
    errors = result["attention"]
    assert {k for k in errors if "float64" in k} and {k for k in errors if "float32" in k}
    assert all(v <= 1e-4 for k, v in errors.items() if "float32" in k), errors
    assert all(v <= 1e-12 for k, v in errors.items() if "float64" in k), errors


def test_fused_qk_topk_naive_ids_are_the_same(result):
    assert result["topk"] and all(v == 0 for v in result["topk"].values()), result["topk"]


def test_unfused_indexer_sparse_attn_from_topk_dense_loss(result):
    assert len(result["indexer_loss"]) == 8 and all(v <= 1e-5 for v in result["indexer_loss"].values()), result["indexer_loss"]


def test_fused_dsa_indexer_loss_at_cp1_dense_and_sparse(result):
    """csa.FusedDSAIndexerLoss (CP 1): the same top-k ids, loss and gradients (<= 1e-5) in one chunk and in 5-row chunks."""
    cases = result["cp1_indexer_loss"]
    assert len(cases) == 20 and {k.split("_")[1] for k in cases} == {"dense", "sparse"}, cases
    assert all(v == 0 for k, v in cases.items() if k.endswith("topk_ids")), cases
    assert all(v <= 1e-5 for k, v in cases.items() if not k.endswith("topk_ids")), cases


def test_install_check_and_a_changed_function_refused(result):
    install = result["install"]
    assert install["check_before_install"] == [] and install["check_while_installed"] == []
    assert install["installed_names"] == ["FusedDSAIndexerLoss", "_unfused_indexer_sparse_attn_from_topk", "fused_qk_topk_naive",
                                          "unfused_compressed_sparse_attn"]
    assert install["core_is_ours"] == "verl_ds4.kernels.sparse_attention" and install["restored"]
    # negative control: a Megatron whose core differs (sink + 0.01) is named and refused
    assert any("csa.unfused_compressed_sparse_attn: output differs" in p for p in install["changed_function_problems"])
    assert "is not the one the linear sparse attention was proven against" in install["changed_function_refused"]
