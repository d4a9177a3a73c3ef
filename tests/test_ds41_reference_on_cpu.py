"""The DeepSeek-V4.1 reference (NeMo Automodel 0.7.0) builds and runs on CPU in fp64.

``verl_ds4.testing.ds41_reference`` builds a random tiny V4.1 with every component on (window-only,
ratio-2 and ratio-1 layers; Full / Reindex / Reuse roles; a hierarchical candidate source; Engram
with a local tokenizer; the DSpark drafter) and drives it in float64. These tests check that the
model really has those components, that its forward runs, and that nothing inside it computes in
float32 (negative control: the same forward outside the fp64 context does).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from verl_ds4.testing import ds41_reference as ref

needs_reference = pytest.mark.skipif(ref.reference_missing() is not None, reason=str(ref.reference_missing()))
DEV_SH = Path(__file__).resolve().parents[1] / "scripts" / "dev.sh"


def pinned_reference(script: str) -> str | None:
    """The NeMo Automodel version ``scripts/dev.sh`` installs (``NEMO_AUTOMODEL_SPEC`` default)."""
    match = re.search(r"NEMO_AUTOMODEL_SPEC=\$\{NEMO_AUTOMODEL_SPEC-nemo-automodel==([0-9.]+)\}", script)
    return match.group(1) if match else None


def test_dev_sh_installs_the_reference_version_the_harness_is_written_for():
    script = DEV_SH.read_text()
    assert pinned_reference(script) == ref.REFERENCE_VERSION
    assert re.search(r'pip install .*--no-deps "\$NEMO_AUTOMODEL_SPEC"', script)
    # negative control: another pin is read as such
    assert pinned_reference(script.replace("==" + ref.REFERENCE_VERSION, "==0.6.0")) == "0.6.0"


class FloatDtypes(TorchFunctionMode):
    """Records the dtype of every floating tensor a torch function returns (a function mode: the
    reference's ``torch.compile``d SwiGLU refuses dispatch modes)."""

    def __init__(self):
        super().__init__()
        self.seen: dict[torch.dtype, set[str]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                self.seen.setdefault(value.dtype, set()).add(getattr(func, "__name__", str(func)))
        return out


@pytest.fixture(scope="module")
def text():
    return ref.tiny_text_config()


@pytest.fixture(scope="module")
def model(text):
    if ref.reference_missing():
        pytest.skip(ref.reference_missing())
    with ref.fp64_reference():
        return ref.build_reference_model(text)


@needs_reference
def test_tiny_model_has_every_v41_component(model, text):
    layers = model.model.layers
    # ratio-2 Full layer: compressor with a gate projection; ratio-1 Full layer: a projection only
    assert layers["2"].attn.compressor.ratio == 2 and hasattr(layers["2"].attn.compressor, "wgate")
    assert layers["5"].attn.compressor.ratio == 1 and not hasattr(layers["5"].attn.compressor, "wgate")
    # Reindex layers own an indexer but no keys; Reuse layers have neither compressor nor indexer
    assert layers["3"].attn.indexer is not None and not layers["3"].attn.indexer.owns_keys
    assert layers["3"].attn.compressor is None
    assert layers["4"].attn.indexer is None and layers["4"].attn.compressor is None
    assert layers["5"].attn.indexer.is_candidate_source and layers["6"].attn.indexer.uses_candidates
    assert not layers["3"].attn.indexer.uses_candidates
    assert [i for i, layer in layers.items() if layer.engram is not None] == ["1", "3"]
    assert model.model.engram_hash is not None
    assert model.model.engram_hash.token_map.unique().numel() == ref.LOCAL_COMPRESSED_VOCAB
    assert text["compress_ratios"][text["num_hidden_layers"] :] == [0, 0, 0]


@needs_reference
def test_reference_forward_runs_in_float64_throughout(model, text):
    ids = torch.randint(0, text["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(3))
    with ref.fp64_reference(), FloatDtypes() as dtypes:
        logits, features, last = ref.reference_forward(model, ids, text["dspark_target_layer_ids"])
    assert logits.dtype == torch.float64 and logits.shape == (2, 16, text["vocab_size"])
    assert torch.isfinite(logits).all() and logits.std() > 0.1
    assert features.shape == (2, 16, 3 * text["hidden_size"]) and last.shape == (2, 16, text["hidden_size"])
    assert set(dtypes.seen) == {torch.float64}, {d: sorted(f)[:5] for d, f in dtypes.seen.items()}


@needs_reference
def test_negative_control_without_the_fp64_context_float32_appears(model, text):
    ids = torch.randint(0, text["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(4))
    with FloatDtypes() as dtypes, pytest.raises(RuntimeError, match="Float but found Double"):
        model(ids)  # fp64 weights meet the reference's float32 steps (its mHC coefficients) and fail
    assert torch.float32 in dtypes.seen


@needs_reference
def test_fp64_reference_is_deterministic_and_sensitive(model, text):
    """The same input gives bit-equal logits; one token changed changes later logits only (causal).

    Earlier rows are equal to rounding, not bit-equal: the changed token moves to other experts, so
    the routed experts' matmuls see other row counts and the CPU's BLAS may block them differently
    (measured 2.7e-15 on rows 6-9 on an AVX-512 EPYC; 0, bit-equal, on an earlier CI machine). A
    non-causal leak would move earlier rows by as much as the later ones (O(1)), far above the 1e-12
    bound."""
    ids = torch.randint(0, text["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(5))
    other, leak = ids.clone(), ids.clone()
    other[0, 10] = (other[0, 10] + 1) % text["vocab_size"]
    leak[0, 5] = (leak[0, 5] + 1) % text["vocab_size"]  # for the negative control below
    with ref.fp64_reference(), torch.no_grad():
        a, b, c, d = (model(x).logits for x in (ids, ids, other, leak))
    assert torch.equal(a, b)
    before = (a[0, :10] - c[0, :10]).abs().max().item()
    after = (a[0, 10:] - c[0, 10:]).abs().amax(-1)
    assert before <= 1e-12 * a.abs().max().item(), before
    assert (after > 1e-3).all(), after
    # negative control: a change inside the compared rows (token 5) breaks the bound
    assert (a[0, :10] - d[0, :10]).abs().max().item() > 1e-3


@needs_reference
def test_dspark_drafter_builds_and_runs(model, text):
    with ref.fp64_reference():
        draft = ref.build_reference_dspark(text)
        assert len(draft.mtp) == 3 and all(stage.attn.compress_ratio == 0 for stage in draft.mtp)
        ids = torch.randint(4, text["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(6))
        torch.manual_seed(0)  # DSpark samples its anchors
        with torch.no_grad():
            _, features, last = ref.reference_forward(model, ids, text["dspark_target_layer_ids"])
            out = draft(ids, features, torch.ones_like(ids), target_last_hidden_states=last)
    logits = out.draft_logits
    assert logits.dtype == torch.float64 and torch.isfinite(logits).all()
    assert logits.shape[-2:] == (text["dspark_block_size"], text["vocab_size"])
