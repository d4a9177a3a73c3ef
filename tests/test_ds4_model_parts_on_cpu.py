"""Unit checks of the DS4 model pieces that the fidelity test cannot reach through transformers:
the top-k tie rule, the softmax score function and norm_topk_prob=False (transformers lacks both),
and config values the CPU model does not implement (each raises, naming the value)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from verl_ds4.models.ds4.hyper_connection import sinkhorn  # noqa: E402
from verl_ds4.models.ds4.model_config import UnsupportedDS4Config, ds4_transformer_config  # noqa: E402
from verl_ds4.models.ds4.moe import DS4Router, stable_topk  # noqa: E402
from verl_ds4.testing.ds4_tiny import tiny_hf_config  # noqa: E402


def test_tie_rule_takes_equal_scores_in_index_order():
    scores = torch.tensor([[0.5, 2.0, 2.0, 2.0, 1.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    assert stable_topk(scores, 2).tolist() == [[1, 2], [0, 1]]
    assert stable_topk(-scores, 2).tolist() != [[1, 2], [0, 1]]  # negative control: the order is the scores'


def test_tie_rule_wrapper_applies_to_torch_topk():
    from verl_ds4.models.ds4.hf_reference import StableTopK

    x = torch.zeros(3, 64)
    with StableTopK():
        assert torch.topk(x, 5).indices.tolist() == [[0, 1, 2, 3, 4]] * 3
        assert x.topk(2, dim=-1).indices.tolist() == [[0, 1]] * 3


def _router(score, norm):
    torch.manual_seed(0)
    r = DS4Router(6, 5, 2, score, norm, 1.5, dtype=torch.float64)
    r.expert_bias.copy_(torch.tensor([0.0, 5.0, 0.0, 0.0, 0.0], dtype=torch.float64))  # forces expert 1
    return r


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_scores_bias_selects_only_and_norm_topk_prob(norm):
    r = _router("softmax", norm)
    x = torch.randn(7, 6, dtype=torch.float64)
    idx, w = r(x)
    probs = torch.softmax(x @ r.weight.T, -1)
    assert (idx[:, 0] == 1).all()  # the bias changed the choice ...
    chosen = probs.gather(-1, idx)  # ... not the weights
    expect = chosen / chosen.sum(-1, keepdim=True) if norm else chosen
    torch.testing.assert_close(w, 1.5 * expect, rtol=1e-12, atol=0)


def test_sinkhorn_is_nearly_doubly_stochastic():
    comb = sinkhorn(torch.randn(10, 3, 3, dtype=torch.float64), 20, 1e-6)
    assert torch.allclose(comb.sum(-2), torch.ones(10, 3, dtype=torch.float64), atol=1e-5)
    assert torch.allclose(comb.sum(-1), torch.ones(10, 3, dtype=torch.float64), atol=1e-4)
    one = sinkhorn(torch.randn(10, 3, 3, dtype=torch.float64) * 5, 1, 1e-6)
    assert not torch.allclose(one.sum(-1), torch.ones(10, 3, dtype=torch.float64), atol=1e-3)  # 1 iteration is not enough


@pytest.mark.parametrize(
    "override, name",
    [
        ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers"),  # MTP itself is supported now
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"n_shared_experts": 2}, "n_shared_experts"),
        ({"router_jitter_noise": 0.1}, "router_jitter_noise"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_unsupported_config_values_raise_naming_them(override, name):
    ds4_transformer_config(tiny_hf_config(), cp_size=1)  # control: the tiny config itself is fine
    with pytest.raises(UnsupportedDS4Config, match=name):
        ds4_transformer_config(tiny_hf_config(**override), cp_size=1)


def test_mtp_can_be_skipped_explicitly():
    config = ds4_transformer_config(tiny_hf_config(num_nextn_predict_layers=1), cp_size=1, allow_mtp_skip=True)
    assert config.num_residual_streams == 2 and config.ds4_mlp_layer_types[0] == "hash_moe"
