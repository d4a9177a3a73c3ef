"""Calibrate the memory model (verl_ds4/recipes/memory.py) against a real allocation on one device.

A scaled-down DS4 is built from this repository's pure-PyTorch DS4 pieces (embedding, layers of
mHC + DS4 attention + DS4 MoE, HC head, final norm, output head; no Megatron, no verl), at DS4-Flash's
real widths (hidden 4096, 64 heads x 512, q_lora 1024, 8 x 1024 output groups, expert width 2048,
4 mHC streams) with fewer layers and experts so that one GPU holds it. It then does what Megatron's
mixed-precision training does, one step:

* bf16 weights; an fp32 main-gradient buffer per parameter; fp32 master weights and Adam's two fp32
  moments (the distributed optimizer on one rank: nothing to shard);
* one forward and backward of ``tokens`` packed rows (no recompute: the estimate is taken with an
  empty ``recompute`` set), gradients added into the fp32 buffers, one Adam step on the masters,
  copied back to bf16.

Reported against the model's figures for the same shape (``DS4Sizes`` of the scaled config,
``training_memory`` on one GPU): the states' bytes (``memory_allocated`` after they exist, minus
what was allocated before), the peak of the step (``max_memory_allocated``) minus the states (the
activations and transient gradients), and the ratios measured / model. On a CPU the same code runs
with tiny widths and counts the tensors' bytes (no allocator): the CPU smoke run of the test suite.

PASS: states within 5% of the model. The activation ratio is reported, not judged: the model's
activation figure is an estimate for fused attention kernels, while this pure-PyTorch attention
materialises its scores.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """The scaled-down DS4 (names as in DeepSeek-V4's config.json)."""

    vocab_size: int = 129280
    hidden_size: int = 4096
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    n_routed_experts: int = 16
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2048
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    compress_ratios: tuple[int, ...] = (4, 128)
    window: int = 128
    tokens: int = 4096


QUICK = Shape(vocab_size=96, hidden_size=32, num_attention_heads=2, head_dim=16, qk_rope_head_dim=8, q_lora_rank=16,
              o_groups=2, o_lora_rank=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
              index_n_heads=2, index_head_dim=8, index_topk=2, hc_mult=2, compress_ratios=(4, 8), window=8, tokens=64)


def model_sizes(shape: Shape):
    from verl_ds4.models.ds4.sizes import DS4Sizes

    fields = {k: getattr(shape, k) for k in DS4Sizes.__dataclass_fields__ if k not in ("compress_ratios", "mtp_layers")}
    return DS4Sizes(**fields, compress_ratios=shape.compress_ratios, mtp_layers=0)


def build(shape: Shape, dtype, device):
    """The scaled-down DS4 as a plain ``nn.Module`` (forward: ids [T], cu [B+1] -> logits [T, V])."""
    import torch
    from torch import nn

    from verl_ds4.models.ds4.attention import DS4AttentionSpec, DS4HybridAttention, _RMSNorm
    from verl_ds4.models.ds4.hyper_connection import DS4HyperConnection, DS4HyperHead
    from verl_ds4.models.ds4.moe import DS4MoE, DS4Router

    h, n = shape.hidden_size, shape.hc_mult

    class Layer(nn.Module):
        def __init__(self, ratio: int):
            super().__init__()
            spec = DS4AttentionSpec(
                hidden_size=h, num_heads=shape.num_attention_heads, head_dim=shape.head_dim, rope_dim=shape.qk_rope_head_dim,
                q_lora_rank=shape.q_lora_rank, o_groups=shape.o_groups, o_lora_rank=shape.o_lora_rank, compress_ratio=ratio,
                window_size=shape.window, index_n_heads=shape.index_n_heads, index_head_dim=shape.index_head_dim,
                index_topk=shape.index_topk,
            )
            self.attn_hc = DS4HyperConnection(h, n, 20, 1e-6, 1e-6, dtype=dtype)
            self.input_layernorm = _RMSNorm(h, 1e-6, dtype=dtype)
            self.self_attention = DS4HybridAttention(spec, dtype=dtype)
            self.mlp_hc = DS4HyperConnection(h, n, 20, 1e-6, 1e-6, dtype=dtype)
            self.pre_mlp_layernorm = _RMSNorm(h, 1e-6, dtype=dtype)
            router = DS4Router(h, shape.n_routed_experts, shape.num_experts_per_tok, "sqrtsoftplus", True, 1.5, dtype=dtype)
            inter = shape.moe_intermediate_size
            self.mlp = DS4MoE(h, router, inter, inter * shape.n_shared_experts, 10.0, dtype=dtype)

        def forward(self, streams, cu):
            streams = self.attn_hc(streams, lambda x: self.self_attention(self.input_layernorm(x), cu))
            return self.mlp_hc(streams, lambda x: self.mlp(self.pre_mlp_layernorm(x)))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(shape.vocab_size, h, dtype=dtype)
            self.layers = nn.ModuleList(Layer(r) for r in shape.compress_ratios)
            self.hc_head = DS4HyperHead(h, n, 1e-6, 1e-6, dtype=dtype)
            self.final_layernorm = _RMSNorm(h, 1e-6, dtype=dtype)
            self.output_layer = nn.Linear(h, shape.vocab_size, bias=False, dtype=dtype)

        def forward(self, ids, cu):
            streams = self.embedding(ids).unsqueeze(-2).expand(-1, n, -1).contiguous()
            for layer in self.layers:
                streams = layer(streams, cu)
            return self.output_layer(self.final_layernorm(self.hc_head(streams)))

    with torch.device(device):
        return Model()


def _allocated(device) -> int:
    import torch

    return torch.cuda.memory_allocated(device) if str(device).startswith("cuda") else 0


def calibrate(device: str = "cuda", quick: bool = False) -> dict:
    """One mixed-precision training step of the scaled-down DS4; measured vs modelled bytes."""
    import torch

    from verl_ds4.recipes.memory import GIB, Mesh, training_memory

    shape = QUICK if quick else Shape()
    on_cuda = device.startswith("cuda")
    torch.manual_seed(0)
    base = _allocated(device)
    model = build(shape, torch.bfloat16, device)
    params = [p for p in model.parameters()]
    main_grads = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    masters = [p.detach().float() for p in params]
    optimizer = torch.optim.Adam(masters, lr=1e-5)
    for m, g in zip(masters, main_grads):  # Adam's moments exist before the step, as after Megatron's first step
        optimizer.state[m]["exp_avg"] = torch.zeros_like(m)
        optimizer.state[m]["exp_avg_sq"] = torch.zeros_like(m)
        optimizer.state[m]["step"] = torch.zeros((), dtype=torch.float32)
    if on_cuda:
        torch.cuda.synchronize()
        states_measured = _allocated(device) - base
        torch.cuda.reset_peak_memory_stats(device)
    else:  # no allocator statistics on a CPU: the tensors' bytes
        tensors = params + main_grads + masters + [v for s in optimizer.state.values() for v in s.values()]
        states_measured = sum(t.numel() * t.element_size() for t in tensors)
    ids = torch.randint(0, shape.vocab_size, (shape.tokens,), device=device)
    lengths = [shape.tokens // 2, shape.tokens - shape.tokens // 2]
    cu = torch.tensor([0, lengths[0], shape.tokens], dtype=torch.int32, device=device)
    t0 = time.perf_counter()
    logits = model(ids, cu)
    loss = torch.nn.functional.cross_entropy(logits.float(), ids.roll(-1))
    loss.backward()
    for p, g in zip(params, main_grads):
        if p.grad is not None:
            g.add_(p.grad.float())
            p.grad = None
    for m, g in zip(masters, main_grads):
        m.grad = g
    optimizer.step()
    with torch.no_grad():
        for p, m in zip(params, masters):
            p.copy_(m.to(p.dtype))
    if on_cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        peak = None
    seconds = time.perf_counter() - t0
    sizes = model_sizes(shape)
    stage = training_memory(sizes, Mesh(world=1), tokens_per_gpu=shape.tokens, recompute=frozenset(), micro_batches=1)[0]
    counted = sum(p.numel() for p in params)
    return {
        "shape": shape, "device": device, "seconds": seconds, "loss": float(loss.detach()),
        "params_built": counted, "params_model": sizes.total(),
        "states_measured_gib": states_measured / GIB, "states_model_gib": stage.static_gib,
        "states_ratio": states_measured / GIB / stage.static_gib,
        "activations_measured_gib": None if peak is None else (peak - states_measured) / GIB,
        "activations_model_gib": stage.activations_gib,
        "peak_measured_gib": None if peak is None else peak / GIB,
        "peak_model_gib": stage.total_gib,
    }


def summary(r: dict) -> tuple[str, bool, str]:
    """(name, ok, detail) of one calibration for the device check's PASS/FAIL line."""
    s = r["shape"]
    name = (f"memory calibration on {r['device']}: {len(s.compress_ratios)} layers, hidden {s.hidden_size}, "
            f"{s.n_routed_experts} experts, {s.tokens} tokens")
    ok = r["params_built"] == r["params_model"] and abs(r["states_ratio"] - 1) <= 0.05
    detail = (f"params built {r['params_built']:,} vs model {r['params_model']:,}; states measured {r['states_measured_gib']:.3f} GiB "
              f"/ model {r['states_model_gib']:.3f} = {r['states_ratio']:.3f}")
    if r["peak_measured_gib"] is not None:
        detail += (f"; activations + transients measured {r['activations_measured_gib']:.2f} GiB / estimate "
                   f"{r['activations_model_gib']:.2f} = {r['activations_measured_gib'] / r['activations_model_gib']:.3f}; "
                   f"step peak {r['peak_measured_gib']:.2f} / model {r['peak_model_gib']:.2f} = "
                   f"{r['peak_measured_gib'] / r['peak_model_gib']:.3f}")
    return name, ok, detail + f"; {r['seconds']:.1f} s"
