"""The bounded logits step: verl-ds4's chunked log-prob / entropy function, and verl's fused path through
verl-ds4's fused forward, against the full ``[T, V]`` computation.

1. :func:`verl_ds4.kernels.chunked_linear_logprobs` vs log-softmax of the full logits (fp64): log-probs,
   entropy, the gradients of hidden and weight, chunk sizes 1 / 7 / all rows, temperature 0.7; at TP 2 on
   gloo (each rank a vocabulary half) vs the full computation. Negative controls: the TP 2 ranks without
   the all-reduce, and a backward that drops the entropy's gradient, are both caught.
2. verl's fused path (verl's patched ``GPTModel`` forward, verl-ds4's ``fused_forward_model_engine``) vs
   the non-fused path (verl-ds4's ``gptmodel_forward_model_engine`` feeding verl's own
   ``_lm_head_logits_processor``) on a real Megatron-Core ``GPTModel`` in fp64: log-probs, entropy and
   every parameter's gradient (to fp32 for the log-probs: Megatron's cross entropy, which verl's
   non-fused path calls, computes in float32). verl's Triton ``linear_cross_entropy`` cannot run on CPU: the chunked
   function stands in for it (same interface). Negative control: a stand-in that ignores the temperature.
"""

from __future__ import annotations

import io

import pytest
import torch

from verl_ds4.kernels import chunked_linear_logprobs
from verl_ds4.kernels.linear_logprobs import _ChunkedLinearLogProbs
from verl_ds4.mcore.distributed import run_distributed

TEMPERATURE = 0.7


def _full(hidden, weight, labels, temperature):
    logp = torch.log_softmax(hidden @ weight.t() / temperature, dim=-1)
    return logp.gather(1, labels[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)


def _case(rows=37, hidden=16, vocab=101, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=gen, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    g_lp, g_h = torch.randn(rows, generator=gen, dtype=torch.float64), torch.randn(rows, generator=gen, dtype=torch.float64)
    return h, w, labels, g_lp, g_h


def _values_and_grads(fn, h, w, labels, g_lp, g_h):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = fn(h, w, labels)
    (lp * g_lp + ent * g_h).sum().backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def _max_errors(got, want):
    return [float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want)]


@pytest.mark.parametrize("chunk_rows", [1, 7, 64])
def test_chunked_equals_the_full_logits(chunk_rows):
    case = _case()
    want = _values_and_grads(lambda h, w, y: _full(h, w, y, TEMPERATURE), *case)
    got = _values_and_grads(lambda h, w, y: chunked_linear_logprobs(h, w, y, TEMPERATURE, chunk_rows=chunk_rows), *case)
    assert got[0].dtype == torch.float64 and got[0].shape == (37,)
    assert max(_max_errors(got, want)) < 1e-12, _max_errors(got, want)


def test_a_backward_without_the_entropy_gradient_is_caught():
    """Negative control: the same comparison fails when the backward drops the entropy's gradient."""

    class NoEntropyGrad(_ChunkedLinearLogProbs):
        @staticmethod
        def backward(ctx, grad_log_probs, grad_entropy):
            return _ChunkedLinearLogProbs.backward(ctx, grad_log_probs, None)

    case = _case()
    want = _values_and_grads(lambda h, w, y: _full(h, w, y, TEMPERATURE), *case)
    got = _values_and_grads(lambda h, w, y: NoEntropyGrad.apply(h, w, y, TEMPERATURE, 7, None), *case)
    errors = _max_errors(got, want)
    assert max(errors[:2]) < 1e-12 and min(errors[2:]) > 1e-2, errors


def test_bad_arguments_are_refused():
    h, w, labels, _, _ = _case()
    with pytest.raises(ValueError, match="reduction='none' only"):
        chunked_linear_logprobs(h, w, labels, 1.0, "mean")
    with pytest.raises(ValueError, match="one label per row"):
        chunked_linear_logprobs(h, w, labels[:-1], 1.0)
    with pytest.raises(ValueError, match="positive float"):
        chunked_linear_logprobs(h, w, labels, 0.0)


def _tp_rank(rank: int, world: int):
    group = torch.distributed.group.WORLD
    h, w, labels, g_lp, g_h = _case(vocab=100)
    shard = w.chunk(world)[rank]
    out = {}
    for name, grp in (("tp", group), ("no_all_reduce", None)):
        fn = lambda hh, ww, y, grp=grp: chunked_linear_logprobs(hh, ww, y, TEMPERATURE, dist_process_group=grp, chunk_rows=9)  # noqa: E731
        out[name] = _values_and_grads(fn, h, shard, labels, g_lp, g_h)
    buffer = io.BytesIO()
    torch.save(out, buffer)
    return buffer.getvalue()


def test_tensor_parallel_vocab_split_equals_the_full_logits():
    ranks = [torch.load(io.BytesIO(b)) for b in run_distributed(_tp_rank, 2, timeout=300)]
    h, w, labels, g_lp, g_h = _case(vocab=100)
    want = _values_and_grads(lambda hh, ww, y: _full(hh, ww, y, TEMPERATURE), h, w, labels, g_lp, g_h)
    for name, expect_ok in (("tp", True), ("no_all_reduce", False)):
        lp, ent = ranks[0][name][0], ranks[0][name][1]
        grad_h = ranks[0][name][2] + ranks[1][name][2]  # each rank's part of d hidden (Megatron's TP region sums it)
        grad_w = torch.cat([ranks[0][name][3], ranks[1][name][3]])
        errors = _max_errors((lp, ent, grad_h, grad_w), want)
        if expect_ok:
            assert torch.equal(ranks[1][name][0], lp) and max(errors) < 1e-12, errors
        else:  # negative control: each rank alone normalises over its half of the vocabulary
            assert min(errors[:2]) > 1e-2, errors


def _fused_vs_unfused(rank: int, world: int):
    import verl.models.mcore.model_forward_fused as verl_fused
    from megatron.core import parallel_state as mpu
    from types import SimpleNamespace
    from verl.models.mcore.model_forward_fused import patch_fused_forward, unpatch_fused_forward
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from verl_ds4.engine.megatron import install_verl_hooks
    from verl_ds4.mcore import resolver
    from verl_ds4.mcore.model_forward import gptmodel_forward_model_engine
    from verl_ds4.mcore.model_forward_fused import fused_forward_model_engine
    from verl_ds4.testing.tiny_gpt import PerTokenAttention, build_tiny_gpt

    mpu.initialize_model_parallel()
    install_verl_hooks()
    stand_ins = {  # verl's Triton kernel cannot run on CPU: the chunked function takes its place
        "chunked": lambda h, w, y, t, r, g: chunked_linear_logprobs(h, w, y, t, r, g, chunk_rows=5),
        "ignores_temperature": lambda h, w, y, t, r, g: chunked_linear_logprobs(h, w, y, 1.0, r, g, chunk_rows=5),
    }
    model = build_tiny_gpt(vocab_size=97, attention=lambda i: PerTokenAttention("contiguous", None), seed=3).double()
    resolved = resolver.resolved_for(model)
    lengths = [5, 19, 11]
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 97, (sum(lengths),), generator=gen)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    nested = lambda v: torch.nested.nested_tensor_from_jagged(v, offsets=offsets)  # noqa: E731
    g_lp, g_h = torch.randn(ids.numel(), generator=gen, dtype=torch.float64), torch.randn(ids.numel(), generator=gen, dtype=torch.float64)
    engine = SimpleNamespace(engine_config=SimpleNamespace(entropy_from_logits_with_chunking=False))

    def verl_processor(logits, label, temperature, **_):  # verl's own logits processor, as its engine binds it
        return MegatronEngineWithLMHead._lm_head_logits_processor(
            engine, logits, label, temperature, calculate_sum_pi_squared=False, calculate_entropy=True,
            distillation_use_topk=False, distillation_only=False, logits_processor_func=None, batch=None,
            data_format="thd",
        )  # fmt: skip

    def run(fused: str | None):
        model.zero_grad(set_to_none=True)
        if fused:
            verl_fused.linear_cross_entropy = stand_ins[fused]
            patch_fused_forward(model)
            out = fused_forward_model_engine(False)(model, nested(ids), nested(ids.clone()), {}, TEMPERATURE, True, 0,
                                                    cp_layout="contiguous", resolved=resolved)  # fmt: skip
            unpatch_fused_forward(model)
        else:
            temps = nested(torch.full((ids.numel(),), TEMPERATURE, dtype=torch.float64))
            args = {"label": nested(ids.clone()), "temperature": temps, "loss_mask": nested(torch.ones_like(ids, dtype=torch.bool))}
            out = gptmodel_forward_model_engine(model, nested(ids), {}, logits_processor=verl_processor,
                                                logits_processor_args=args, cp_layout="contiguous", resolved=resolved)  # fmt: skip
        lp, ent = out["log_probs"].values(), out["entropy"].values()
        (lp * g_lp + ent * g_h).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return lp.detach(), ent.detach(), grads

    result = {"unfused": run(None), **{name: run(name) for name in stand_ins}}
    mpu.destroy_model_parallel()
    buffer = io.BytesIO()
    torch.save(result, buffer)
    return buffer.getvalue()


def test_fused_path_through_verl_ds4_equals_the_non_fused_path():
    blob = run_distributed(_fused_vs_unfused, 1, timeout=300)[0]
    out = torch.load(io.BytesIO(blob), weights_only=False)
    u_lp, u_ent, u_grads = out["unfused"]
    for stand_in in ("chunked", "ignores_temperature"):
        f_lp, f_ent, f_grads = out[stand_in]
        assert f_lp.dtype == torch.float64 and f_lp.shape == u_lp.shape == (35,)
        assert set(f_grads) == set(u_grads) and len(u_grads) >= 10
        errors = _max_errors([f_lp, f_ent, *f_grads.values()], [u_lp, u_ent, *(u_grads[n] for n in f_grads)])
        if stand_in == "chunked":
            # The entropy agrees to fp64 (1e-16); the log-probs and so the gradients to fp32, because the non-fused
            # reference's Megatron vocab_parallel_cross_entropy casts the logits to float32 (measured <= 8.3e-8).
            assert errors[1] < 1e-12 and max(errors) < 1e-6, errors
        else:  # negative control: the comparison sees a kernel that drops the temperature (measured 3e-2, 2e-3)
            assert min(errors[:2]) > 1e-3 and max(errors) > 1e-2, errors
