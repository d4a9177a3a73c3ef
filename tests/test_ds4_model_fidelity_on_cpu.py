"""The full Megatron DS4 (mHC, DS4 attention, DS4 MoE with hash layers, HC head) equals transformers'
``DeepseekV4ForCausalLM`` at fp64, at CP = 1, 2 and 4 (gloo processes, packed THD, contiguous layout).

The reference runs under ``fp64_reference()`` (its float32 steps promoted to float64, its top-k under
our tie rule: equal scores in index order). Every component is active in the tiny model
(``verl_ds4.testing.ds4_tiny``): hc_mult 2, 4 experts top-2 plus a shared expert, a hash layer,
a SwiGLU clamp the activations exceed, sliding / CSA (indexer top-2 of up to 15 blocks) / HCA layers.
Negative controls: hash ids packed with a plan shifted by one row, and mHC replaced by a plain
residual, both break the match.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from verl_ds4.models.ds4.hf_check import run_on_cp_ranks  # noqa: E402
from verl_ds4.models.ds4.hf_reference import fp64_reference, hf_model_logits  # noqa: E402
from verl_ds4.testing.ds4_tiny import file_tensors, random_hf_model, random_sequences, tiny_hf_config  # noqa: E402

# 121 tokens: at CP 4 each rank holds 31 rows (>= D_window 8); 37 and 60 straddle rank boundaries,
# 5 is shorter than a rank.
LENGTHS = [37, 5, 60, 19]
TOL = 1e-10


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def log_probs(logits: list[torch.Tensor], seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-token log p(next token) of each sequence (last token has no label)."""
    return [torch.log_softmax(x[:-1], -1).gather(-1, s[1:].view(-1, 1))[:, 0] for x, s in zip(logits, seqs)]


class _Builder:
    """Builds our model on a rank from the reference's weights (picklable-free: runs under fork)."""

    def __init__(self, cfg, tensors):
        self.cfg, self.tensors = cfg.to_dict(), tensors

    def __call__(self, cp_size):
        from verl_ds4.models.ds4.hf_checkpoint import load_into
        from verl_ds4.models.ds4.model import build_ds4_model

        model = build_ds4_model(self.cfg, dtype=torch.float64, cp_size=cp_size)
        load_into(model, self.tensors)
        return model.eval()


@pytest.fixture(scope="module")
def case():
    cfg = tiny_hf_config()
    hf = random_hf_model(cfg, seed=0)
    seqs = random_sequences(LENGTHS, cfg.vocab_size, seed=3)
    seen = {"max": 0.0}

    def grab(module, inputs, output):
        seen["max"] = max(seen["max"], output.abs().max().item())

    hook = hf.model.layers[1].mlp.shared_experts.gate_proj.register_forward_hook(grab)
    with fp64_reference():
        ref = hf_model_logits(hf, seqs)
    hook.remove()
    return dict(cfg=cfg, seqs=seqs, ref=ref, builder=_Builder(cfg, file_tensors(hf)), gate_max=seen["max"])


def test_every_component_is_active(case):
    cfg = case["cfg"]
    assert cfg.hc_mult >= 2 and cfg.n_routed_experts >= 4 and cfg.num_experts_per_tok == 2 and cfg.n_shared_experts == 1
    assert "hash_moe" in cfg.mlp_layer_types and set(cfg.layer_types) == {
        "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"}
    assert max(LENGTHS) // 4 > cfg.index_topk  # the indexer really selects
    assert case["gate_max"] > cfg.swiglu_limit  # the SwiGLU clamp is reached


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_logits_and_log_probs_match_transformers(case, cp):
    got = run_on_cp_ranks(case["builder"], case["seqs"], cp)
    assert [g.shape for g in got] == [r.shape for r in case["ref"]]
    logit_err = max(rel(g, r) for g, r in zip(got, case["ref"]))
    lp_err = max(rel(g, r) for g, r in zip(log_probs(got, case["seqs"]), log_probs(case["ref"], case["seqs"])))
    print(f"CP={cp}: max rel error logits {logit_err:.3e}, log-probs {lp_err:.3e}")
    assert logit_err <= TOL and lp_err <= TOL


def test_hash_ids_packed_with_a_shifted_plan_break_the_match(case):
    got = run_on_cp_ranks(case["builder"], case["seqs"], 2, hash_ids_shift=1)
    assert max(rel(g, r) for g, r in zip(got, case["ref"])) > 1e-3


def test_mhc_disabled_differs_from_the_reference(case, monkeypatch):
    from verl_ds4.models.ds4.hyper_connection import DS4HyperConnection

    # A plain residual on the stream mean instead of mHC (inherited by the forked ranks).
    monkeypatch.setattr(DS4HyperConnection, "forward", lambda self, streams, sublayer: streams + sublayer(streams.mean(-2)).unsqueeze(-2))
    got = run_on_cp_ranks(case["builder"], case["seqs"], 1)
    assert max(rel(g, r) for g, r in zip(got, case["ref"])) > 1e-3
