"""The released V4.1 cache rounding (``verl_ds4.models.ds41.cache_qdq``) against NeMo Automodel 0.7.0.

* each format (FP8 window KV, MXFP4 indexer, NVFP4 compressed KV) is bit-equal to the reference's
  ``quantize_cache`` on float32 values over 11 decades and on exact e2m1 ties; rounding ties away
  from zero instead (negative control) is not; the gradient passes straight through;
* the 8 CSA2 tiny layers in float32 with ``cache_qdq=True`` equal the reference with its rounding on
  to float32 accuracy (<= 1e-6 relative); without our rounding they are >= 1e-2 off (negative control).
"""

from __future__ import annotations

import pytest
import torch

from verl_ds4.models.ds41 import names
from verl_ds4.models.ds41.cache_qdq import FORMATS, cache_qdq
from verl_ds4.models.ds41.csa2 import CSA2State, DS41Attention
from verl_ds4.testing import ds41_reference as ref

pytestmark = pytest.mark.skipif(ref.reference_missing() is not None, reason=str(ref.reference_missing()))

TEXT = ref.tiny_text_config()
TIES = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -2.5, -5.0, 6.0] * 3])  # amax 6: scale 1


def reference(x, fmt):
    from nemo_automodel.components.models.deepseek_v41.quantization import quantize_cache

    return quantize_cache(x, format=fmt, block_size=FORMATS[fmt])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_formats_bit_equal_the_reference(fmt):
    g = torch.Generator().manual_seed(0)
    for scale in (1e-6, 1e-3, 1.0, 1e2, 1e5):
        x = torch.randn(64, 70, generator=g) * scale  # 70 channels: a partial last block too
        assert torch.equal(cache_qdq(x, fmt), reference(x, fmt)), (fmt, scale)
        assert not torch.equal(cache_qdq(x, fmt), x)
    assert torch.equal(cache_qdq(TIES, fmt), reference(TIES, fmt))


def test_ties_go_to_the_even_mantissa():
    got = cache_qdq(TIES, "mxfp4")[0, :7]
    assert got.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    away = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # negative control: ties away from zero
    assert not torch.equal(away, reference(TIES, "mxfp4")[0, :7])


def test_gradient_passes_straight_through():
    x = torch.randn(4, 32, requires_grad=True)
    upstream = torch.randn(4, 32)
    cache_qdq(x, "nvfp4").backward(upstream)
    assert torch.equal(x.grad, upstream)


def test_csa2_layers_with_cache_rounding_equal_the_reference_in_float32():
    from nemo_automodel.components.models.deepseek_v41.attention import DeepseekV41Attention, DeepseekV41AttentionState
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig

    g = torch.Generator().manual_seed(100)
    xs = [torch.randn(16, TEXT["hidden_size"], generator=g) for _ in range(TEXT["num_hidden_layers"])]
    errors = {}
    for rounding in (True, False):
        theirs_state, ours_state, errs = DeepseekV41AttentionState(), CSA2State(), []
        for layer, x in enumerate(xs):
            with ref.reference_context(fp64=False, quantize=True):
                theirs = DeepseekV41Attention(DeepseekV41TextConfig(**TEXT), layer, ref.reference_backend()).float()
            ref._randomise(theirs, torch.Generator().manual_seed(layer), std=0.3)
            ours = DS41Attention(TEXT, layer, dtype=torch.float32, cache_qdq=rounding)
            with torch.no_grad():
                for name, param in ours.named_parameters():
                    param.copy_(theirs.get_parameter(names.ATTENTION[name]))
                with ref.reference_context(fp64=False, quantize=True):
                    result = theirs(x.unsqueeze(0), position_ids=torch.arange(16).unsqueeze(0), state=theirs_state)
                theirs_state = result.state
                out, ours_state = ours(x, ours_state)
            errs.append(float((out - result.hidden_states[0]).abs().max() / result.hidden_states[0].abs().max()))
        errors[rounding] = errs
    print("float32 with the cache rounding:", ", ".join(f"{e:.1e}" for e in errors[True]))
    print("without ours:", ", ".join(f"{e:.1e}" for e in errors[False]))
    assert max(errors[True]) <= 1e-6 and min(errors[False]) >= 1e-2
