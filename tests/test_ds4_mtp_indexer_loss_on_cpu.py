"""DS4 MTP and the lightning indexer's KL loss: CP = 1 / 2 / 4 exact at fp64, an independent fp64 MTP
reference, checkpoint names, and negative controls (gloo ranks, packed THD, contiguous layout).

The MTP reference is written here, per sequence, from the checkpoint tensors: the decoder's residual
streams come from transformers (a hook on its HC head; transformers builds no MTP), the
enorm / hnorm / e_proj / h_proj / HC head / norm / shared head / cross entropy are inline formulas,
and the inner window-only layer is our ``DS4DecoderLayer`` run alone on one unpacked sequence (that
layer equals transformers' in tests/test_ds4_model_fidelity_on_cpu.py). Packing, the per-sequence
roll, CP and the loss bookkeeping are therefore checked against plain slicing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from verl_ds4.models.ds4 import cp_comm, mtp as mtp_mod  # noqa: E402
from verl_ds4.testing.ds4_tiny import file_tensors, random_hf_model, random_sequences, tiny_hf_config  # noqa: E402

# 124 rows, every length a multiple of 4: the plan adds no padding at CP 1 / 2 / 4 (31 rows per rank at
# CP 4), so the indexer loss (padded rows are queries, as in dev) compares exactly; 36 and 60 straddle ranks.
LENGTHS = [36, 8, 60, 20]
TOL = 1e-10
DEPTHS = 2


def rel(a, b) -> float:
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


def grad_rel(got: dict, ref: dict, names) -> float:
    """Max over tensors of |got - ref|max / max(|ref|max, 1e-4 * largest |ref|): each tensor on its own
    scale, floored where a gradient cancels to rounding level (layer 0's mHC alphas: every stream starts
    as the same embedding, so their gradients sum to ~1e-12 of the others and carry ~1e-18 noise)."""
    top = max(float(np.abs(ref[n]).max()) for n in names)
    return max(float(np.abs(got[n] - ref[n]).max()) / max(float(np.abs(ref[n]).max()), 1e-4 * top) for n in names)


def _mtp_tensors(names_and_shapes, seed=5):
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(names_and_shapes.items()):
        noise = torch.randn(shape, generator=gen, dtype=torch.float64)
        if "norm" in name:
            out[name] = 1.0 + 0.2 * noise
        elif name.endswith("scale"):
            out[name] = 1.0 + 0.3 * noise
        elif len(shape) >= 2:
            out[name] = noise * shape[-1] ** -0.5
        elif name.endswith("gate.bias"):
            out[name] = 0.5 * noise
        else:
            out[name] = 0.5 * noise
    return out


class _Builder:
    def __init__(self, cfg, tensors, overrides=None):
        self.cfg, self.tensors, self.overrides = cfg.to_dict(), tensors, overrides

    def __call__(self, cp_size):
        from verl_ds4.models.ds4.hf_checkpoint import load_into
        from verl_ds4.models.ds4.model import build_ds4_model

        model = build_ds4_model(self.cfg, dtype=torch.float64, cp_size=cp_size, config_overrides=self.overrides)
        load_into(model, self.tensors)
        return model.train()


def _rank_main(rank, world, build, seqs):
    import logging

    from megatron.core import parallel_state

    from verl_ds4.layout import PlanOptions
    from verl_ds4.mcore.thd import make_plan, pack_input, packed_seq_params_for
    from verl_ds4.models.ds4.indexer_loss import indexer_loss_report
    from verl_ds4.models.ds4.mtp import mtp_loss_report

    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    parallel_state.initialize_model_parallel(context_parallel_size=world)
    try:
        model = build(world)
        cp_rank = parallel_state.get_context_parallel_rank()
        lengths = [int(s.numel()) for s in seqs]
        offsets = torch.tensor([0, *lengths]).cumsum(0)
        nested = torch.nested.nested_tensor_from_jagged(torch.cat(seqs), offsets=offsets)
        ones = torch.nested.nested_tensor_from_jagged(torch.ones(int(offsets[-1]), dtype=torch.float64), offsets=offsets)
        plan = make_plan(nested, PlanOptions(layout="contiguous", cp_size=world, min_local_rows=model.config.min_local_rows))
        params = packed_seq_params_for(plan, layout_consumer_checked=True)
        ids, _ = pack_input(nested, plan, cp_rank)
        mask, _ = pack_input(ones, plan, cp_rank)
        logits = model(ids, None, None, packed_seq_params=params, loss_mask=mask)
        (logits * 0).sum().backward()  # only the auxiliary losses' gradients
        group = parallel_state.get_context_parallel_group()
        grads = {}
        for name, p in sorted(model.named_parameters()):
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            g = g.clone()
            if world > 1:
                torch.distributed.all_reduce(g, group=group)
            grads[name] = g.numpy()
        out = dict(mtp=mtp_loss_report(model), indexer=indexer_loss_report(model), grads=grads,
                   total_rows=int(params.cu_seqlens_q_padded[-1]))
        return out if rank == 0 else None
    finally:
        parallel_state.destroy_model_parallel()


def _child_main(rank, world, fn, args):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    try:
        return fn(*args)
    finally:
        parallel_state.destroy_model_parallel()


def in_child(fn, *args):
    """``fn(*args)`` in a forked process with Megatron's parallel state (Megatron models need it)."""
    from verl_ds4.mcore.distributed import run_distributed

    return run_distributed(_child_main, world_size=1, args=(fn, args), timeout=300)[0]


def _mtp_shapes(cfg):
    from verl_ds4.models.ds4.hf_checkpoint import hf_tensors_of
    from verl_ds4.models.ds4.model import build_ds4_model

    return {n: tuple(t.shape) for n, t in hf_tensors_of(build_ds4_model(cfg, dtype=torch.float64)).items() if n.startswith("mtp.")}


def run(build, seqs, cp):
    from verl_ds4.mcore.distributed import run_distributed

    return run_distributed(_rank_main, world_size=cp, args=(build, list(seqs)), timeout=300)[0]


# -- fixtures --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mtp_case():
    cfg = tiny_hf_config(num_nextn_predict_layers=DEPTHS)
    hf = random_hf_model(cfg, seed=0)
    shapes = in_child(_mtp_shapes, cfg.to_dict())
    tensors = {**file_tensors(hf), **_mtp_tensors(shapes)}
    seqs = random_sequences(LENGTHS, cfg.vocab_size, seed=3)
    return dict(cfg=cfg, hf=hf, tensors=tensors, seqs=seqs, builder=_Builder(cfg, tensors))


@pytest.fixture(scope="module")
def mtp_cp1(mtp_case):
    return run(mtp_case["builder"], mtp_case["seqs"], 1)


def _reference_mtp_losses(case) -> list[float]:
    return in_child(_reference_mtp_losses_here, case)


def _reference_mtp_losses_here(case) -> list[float]:
    """Per-depth token-mean CE over all sequences, computed per sequence with plain slicing."""
    from verl_ds4.models.ds4.hf_reference import fp64_reference
    from verl_ds4.models.ds4.model import build_ds4_model
    from verl_ds4.models.ds4.hf_checkpoint import load_into

    hf, t, cfg = case["hf"], case["tensors"], case["cfg"]
    streams0 = []
    hook = hf.model.hc_head.register_forward_pre_hook(lambda mod, args: streams0.append(args[0][0].clone()))
    with fp64_reference(), torch.no_grad():
        for s in case["seqs"]:
            hf(input_ids=s.view(1, -1), use_cache=False)
    hook.remove()
    ours = build_ds4_model(cfg.to_dict(), dtype=torch.float64, cp_size=1)
    load_into(ours, t)
    eps, hc_eps, n = cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_mult

    def rms(x, w):
        return w * x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)

    ce_sum, count = [0.0] * DEPTHS, [0] * DEPTHS
    with torch.no_grad():
        for s, h in zip(case["seqs"], streams0):  # h: [L, n, hidden]
            L = s.numel()
            for k in range(DEPTHS):
                p = f"mtp.{k}."
                nxt = s[k + 1 :]  # token i + k + 1 at row i (rows i < L - k - 1)
                rows = nxt.numel()
                e = rms(t["model.embed_tokens.weight"][nxt], t[p + "enorm.weight"]) @ t[p + "e_proj.weight"].T
                x = e[:, None, :] + rms(h[:rows], t[p + "hnorm.weight"]) @ t[p + "h_proj.weight"].T
                h = ours.mtp.layers[k].mtp_model_layer(x[:, None])[:, 0]  # one sequence, BSHD, CP 1
                flat = h.flatten(-2)
                z = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
                pre = torch.sigmoid(z @ t[p + "hc_head_fn"].T * t[p + "hc_head_scale"] + t[p + "hc_head_base"]) + hc_eps
                out = rms((pre[..., None] * h).sum(-2), t[p + "norm.weight"])
                logp = torch.log_softmax(out @ t["head.weight"].T, -1)
                labels = s[k + 2 :]  # token i + k + 2: rows i < L - k - 2 have a label
                ce_sum[k] += float(-logp[: labels.numel()].gather(-1, labels[:, None]).sum())
                count[k] += labels.numel()
                assert n == h.shape[-2]
    return [c / m for c, m in zip(ce_sum, count)]


# -- MTP -------------------------------------------------------------------------------------------
def test_mtp_matches_the_independent_reference(mtp_case, mtp_cp1):
    ref = _reference_mtp_losses(mtp_case)
    got = [mtp_cp1["mtp"][f"mtp_{k + 1} loss"] for k in range(DEPTHS)]
    print("MTP losses", got, "reference", ref)
    assert max(abs(g - r) / abs(r) for g, r in zip(got, ref)) <= TOL
    scaled = mtp_cp1["mtp"]["mtp loss (scaled)"]
    assert abs(scaled - 0.1 / DEPTHS * sum(ref)) <= TOL * abs(scaled)  # mtp_loss_scaling_factor 0.1


@pytest.mark.parametrize("cp", [2, 4])
def test_mtp_loss_and_gradients_are_cp_exact(mtp_case, mtp_cp1, cp):
    got = run(mtp_case["builder"], mtp_case["seqs"], cp)
    assert got["total_rows"] == mtp_cp1["total_rows"] == sum(LENGTHS)
    loss_err = max(rel(got["mtp"][k], mtp_cp1["mtp"][k]) for k in mtp_cp1["mtp"])
    with_grad = [n for n, g in mtp_cp1["grads"].items() if np.abs(g).max() > 0]
    assert any(n.startswith("mtp.layers.1.") for n in with_grad) and "embedding.word_embeddings.weight" in with_grad
    assert any(n.startswith("decoder.layers.0.") for n in with_grad)  # MTP trains the trunk too
    grad_err = grad_rel(got["grads"], mtp_cp1["grads"], with_grad)
    print(f"MTP CP={cp}: loss rel err {loss_err:.3e}, grad rel err {grad_err:.3e} over {len(with_grad)} tensors")
    assert loss_err <= TOL and grad_err <= TOL


def test_a_roll_across_sequence_boundaries_fails_the_reference(mtp_case, monkeypatch):
    monkeypatch.setattr(mtp_mod, "_RESPECT_SEQUENCE_BOUNDARIES", False)  # inherited by the forked ranks
    got = run(mtp_case["builder"], mtp_case["seqs"], 1)
    ref = _reference_mtp_losses(mtp_case)
    assert max(abs(got["mtp"][f"mtp_{k + 1} loss"] - r) / r for k, r in enumerate(ref)) > 1e-3


def test_a_roll_without_the_next_rank_row_breaks_cp_exactness(mtp_case, mtp_cp1, monkeypatch):
    monkeypatch.setattr(mtp_mod, "next_rank_first_row", lambda x, group: torch.zeros_like(x[0]))
    got = run(mtp_case["builder"], mtp_case["seqs"], 2)
    assert max(rel(got["mtp"][k], mtp_cp1["mtp"][k]) for k in mtp_cp1["mtp"]) > 1e-6


def test_mtp_leaves_the_lm_logits_unchanged(mtp_case):
    in_child(_same_logits, mtp_case)


def _same_logits(mtp_case):
    from verl_ds4.models.ds4.hf_checkpoint import load_into
    from verl_ds4.models.ds4.model import build_ds4_model

    cfg, tensors = mtp_case["cfg"].to_dict(), mtp_case["tensors"]
    ids = torch.cat(mtp_case["seqs"]).view(1, -1)
    with_mtp = build_ds4_model(cfg, dtype=torch.float64)
    load_into(with_mtp, tensors)
    without = build_ds4_model(cfg, dtype=torch.float64, allow_mtp_skip=True)
    load_into(without, tensors, allow_mtp_skip=True)
    a, b = with_mtp(ids, None, None), without(ids, None, None)  # autograd on: MTP runs in the first
    assert with_mtp.mtp.last_losses is not None and torch.equal(a, b)


def test_mtp_model_takes_the_router_padding_mask_verls_engine_passes(mtp_case):
    in_child(_padding_mask_accepted, mtp_case)


def _padding_mask_accepted(mtp_case):
    """verl's engine passes ``padding_mask`` (the router padding mask) to every MoE model; with MTP on,
    the forward takes it (it has no effect: this MoE has no auxiliary loss) and still refuses others."""
    from verl_ds4.models.ds4.hf_checkpoint import load_into
    from verl_ds4.models.ds4.model import build_ds4_model

    model = build_ds4_model(mtp_case["cfg"].to_dict(), dtype=torch.float64)
    load_into(model, mtp_case["tensors"])
    ids = torch.cat(mtp_case["seqs"]).view(1, -1)
    plain = model(ids, None, None)
    plain_mtp = model.mtp.last_losses
    masked = model(ids, None, None, padding_mask=torch.zeros_like(ids, dtype=torch.bool))
    assert torch.equal(plain, masked) and model.mtp.last_losses is not None
    assert torch.equal(plain_mtp, model.mtp.last_losses)
    # negative control: a keyword the MTP forward does not implement is still refused, by name
    with pytest.raises(TypeError, match="does not take \\['not_a_kwarg'\\]"):
        model(ids, None, None, not_a_kwarg=torch.ones(1))


def test_mtp_checkpoint_tensors_load_and_save_bit_exact(mtp_case):
    in_child(_checkpoint_checks, mtp_case)


def _checkpoint_checks(mtp_case):
    from verl_ds4.models.ds4.hf_checkpoint import HFCheckpointError, hf_tensors_of, load_into
    from verl_ds4.models.ds4.model import build_ds4_model

    cfg, tensors = mtp_case["cfg"], mtp_case["tensors"]
    model = build_ds4_model(cfg.to_dict(), dtype=torch.float64)
    load_into(model, tensors)
    assert torch.equal(model.mtp.layers[1].e_proj.weight, tensors["mtp.1.e_proj.weight"])
    assert torch.equal(model.mtp.layers[0].mtp_model_layer.self_attention.linear_q_down_proj.weight, tensors["mtp.0.attn.wq_a.weight"])
    for family in ("transformers", "native"):
        saved = hf_tensors_of(model, family, {n: torch.float64 for n in tensors})
        mtp_names = sorted(n for n in saved if n.startswith("mtp."))
        assert mtp_names == sorted(n for n in tensors if n.startswith("mtp."))
        assert all(torch.equal(saved[n], tensors[n]) for n in mtp_names)
    missing = dict(tensors)
    del missing["mtp.0.hc_head_fn"]
    with pytest.raises(HFCheckpointError, match=r"allow_mtp_skip=True\).*missing tensor 'mtp.0.hc_head_fn'"):
        load_into(build_ds4_model(cfg.to_dict(), dtype=torch.float64), missing)
    skipped = build_ds4_model(cfg.to_dict(), dtype=torch.float64, allow_mtp_skip=True)
    info = load_into(skipped, tensors, allow_mtp_skip=True)
    assert skipped.mtp_block is None and "mtp.0.e_proj.weight" in info.skipped


def test_mtp_config_errors_name_the_value(mtp_case):
    in_child(_config_errors, mtp_case)


def _config_errors(mtp_case):
    from verl_ds4.models.ds4.model import build_ds4_model

    with pytest.raises(ValueError, match="allow_mtp_skip=True"):
        build_ds4_model(mtp_case["cfg"].to_dict(), dtype=torch.float64, value_head=True)
    with pytest.raises(ValueError, match="cu_seqlens"):
        mtp_mod.roll_packed_left(torch.arange(6), torch.tensor([0, 5]))


# -- indexer loss ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def idx_case():
    cfg = tiny_hf_config()
    hf = random_hf_model(cfg, seed=1)
    seqs = random_sequences(LENGTHS, cfg.vocab_size, seed=4)
    tensors = file_tensors(hf)
    return dict(cfg=cfg, seqs=seqs, tensors=tensors, builder=_Builder(cfg, tensors, dict(dsa_indexer_loss_coeff=0.25)))


@pytest.fixture(scope="module")
def idx_cp1(idx_case):
    return run(idx_case["builder"], idx_case["seqs"], 1)


def _indexer_grads(result):
    return {n: g for n, g in result["grads"].items() if ".indexer." in n}


def test_indexer_loss_trains_the_indexer_only(idx_cp1):
    assert idx_cp1["indexer"] is not None and idx_cp1["indexer"] > 0
    grads = idx_cp1["grads"]
    assert all(np.abs(g).max() > 0 for g in _indexer_grads(idx_cp1).values()) and _indexer_grads(idx_cp1)
    assert all(np.abs(g).max() == 0 for n, g in grads.items() if ".indexer." not in n)


@pytest.mark.parametrize("cp", [2, 4])
def test_indexer_loss_and_gradients_are_cp_exact(idx_case, idx_cp1, cp):
    got = run(idx_case["builder"], idx_case["seqs"], cp)
    loss_err = rel(got["indexer"], idx_cp1["indexer"])
    ref = _indexer_grads(idx_cp1)
    grad_err = max(rel(got["grads"][n], g) for n, g in ref.items())
    print(f"indexer CP={cp}: loss rel err {loss_err:.3e}, grad rel err {grad_err:.3e} over {len(ref)} tensors")
    assert loss_err <= TOL and grad_err <= TOL


def test_indexer_loss_counts_real_tokens_not_the_cp_padding(idx_case, monkeypatch):
    """70 real tokens: no padding at CP 1, padding rows at CP 2. Queries and divisor are the
    real tokens (from the plan), so the loss is the same. Negative control: counting the padded
    rows, as Megatron-LM dev does with verl's padded cu_seqlens, makes it depend on the CP size."""
    from verl_ds4.models.ds4.mcore_attention import DS4HybridSelfAttention

    seqs = random_sequences([3, 50, 17], idx_case["cfg"].vocab_size, seed=5)
    cp1, cp2 = run(idx_case["builder"], seqs, 1), run(idx_case["builder"], seqs, 2)
    assert cp1["total_rows"] == 70 < cp2["total_rows"]  # CP 2 pads (divisibility, row minimum)
    assert cp1["indexer"] > 0 and rel(cp2["indexer"], cp1["indexer"]) <= TOL
    monkeypatch.setattr(DS4HybridSelfAttention, "_real_seqlens", staticmethod(lambda params: None))  # forked ranks inherit it
    padded2 = run(idx_case["builder"], seqs, 2)  # (at CP 1 there is no padding to count)
    assert rel(padded2["indexer"], cp1["indexer"]) > 1e-3


def test_indexer_keys_gathered_without_backward_break_the_gradients(idx_case, idx_cp1, monkeypatch):
    def local_only_backward(ctx, grad):
        start = sum(ctx.counts[: ctx.rank])
        return grad[start : start + ctx.counts[ctx.rank]], None, None

    monkeypatch.setattr(cp_comm._AllGatherRows, "backward", staticmethod(local_only_backward))
    got = run(idx_case["builder"], idx_case["seqs"], 2)
    assert rel(got["indexer"], idx_cp1["indexer"]) <= TOL  # the forward is still exact
    assert max(rel(got["grads"][n], g) for n, g in _indexer_grads(idx_cp1).items()) > 1e-6


def test_indexer_loss_matches_a_loop_reference(monkeypatch):
    """The KL against an explicit per-row, per-head loop (softmax over window + sink + all blocks)."""
    from verl_ds4.models.ds4 import indexer_loss

    gen = torch.Generator().manual_seed(0)
    T, n, d, W, NB = 9, 3, 4, 5, 6
    q, comp = torch.randn(T, n, d, generator=gen, dtype=torch.float64), torch.randn(NB, d, generator=gen, dtype=torch.float64)
    win = torch.randn(T, n, W, generator=gen, dtype=torch.float64)
    win[:, :, 3:] = float("-inf")
    sink = torch.randn(n, generator=gen, dtype=torch.float64)
    valid = torch.rand(T, NB, generator=gen) < 0.6
    valid[0] = False  # a row that sees no block
    scores = torch.randn(T, NB, generator=gen, dtype=torch.float64)
    got = indexer_loss.indexer_kl_sum(q, comp, win, sink, valid, scores, 0.5)
    want = 0.0
    for i in range(T):
        idx = [b for b in range(NB) if valid[i, b]]
        if not idx:
            continue
        mass = torch.zeros(len(idx), dtype=torch.float64)
        for h in range(n):
            comp_logits = torch.stack([q[i, h] @ comp[b] * 0.5 for b in idx])
            denom = win[i, h, :3].exp().sum() + sink[h].exp() + comp_logits.exp().sum()
            mass += comp_logits.exp() / denom
        t = mass / mass.sum()
        s = scores[i, idx].exp() / scores[i, idx].exp().sum()
        want += float((t * (t.log() - s.log())).sum())
    assert abs(float(got) - want) <= 1e-12 * abs(want)
    # Negative control: dropping the window + sink mass changes the head weighting, hence the loss.
    no_window = indexer_loss.indexer_kl_sum(q, comp, torch.full_like(win, float("-inf")), torch.full_like(sink, -1e30), valid, scores, 0.5)
    assert abs(float(no_window) - want) > 1e-6 * abs(want)


def test_coefficient_zero_costs_nothing_and_changes_nothing(idx_case):
    in_child(_coefficient_zero, idx_case)


def _coefficient_zero(idx_case):
    from verl_ds4.models.ds4 import indexer_loss

    monkeypatch = pytest.MonkeyPatch()

    zero = _Builder(idx_case["cfg"], idx_case["tensors"], dict(dsa_indexer_loss_coeff=0.0))
    unset = _Builder(idx_case["cfg"], idx_case["tensors"], None)
    model_a, model_b = zero(1), unset(1)
    ids = torch.cat(idx_case["seqs"]).view(1, -1)

    def boom(*a, **k):
        raise AssertionError("the indexer loss ran with coefficient 0")

    monkeypatch.setattr(indexer_loss, "indexer_kl_sum", boom)
    outs = []
    for model in (model_a, model_b):
        logits = model(ids, None, None)
        (logits.square().sum()).backward()
        outs.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (la, ga), (lb, gb) = outs
    assert torch.equal(la, lb) and ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga)
    assert not any(".indexer." in k for k in ga)  # no indexer gradient without the loss
    # Negative control: the same check with a positive coefficient sees indexer gradients.
    monkeypatch.undo()
    pos = _Builder(idx_case["cfg"], idx_case["tensors"], dict(dsa_indexer_loss_coeff=0.25))(1)
    pos(ids, None, None).square().sum().backward()
    assert any(".indexer." in n and p.grad is not None for n, p in pos.named_parameters())


def test_sparse_indexer_loss_raises():
    from verl_ds4.models.ds4.model import build_ds4_model

    with pytest.raises(ValueError, match="dsa_indexer_use_sparse_loss"):
        build_ds4_model(tiny_hf_config(), dtype=torch.float64, config_overrides=dict(dsa_indexer_use_sparse_loss=True))
