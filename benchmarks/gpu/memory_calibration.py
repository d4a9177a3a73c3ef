"""Calibrate the memory model (verl_ds4/memory/stages.py) against a real allocation on one device.

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


#: The largest |model / measured - 1| the calibration accepts for the step's peak above the states.
TOLERANCE = 0.10

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
            # all query rows in one chunk, its tensors kept for backward: the layer as Megatron-LM dev's unfused
            # path runs it and as the committed H200 records measured it (verl_ds4.models.query_chunks)
            self.self_attention.query_chunk_rows = shape.tokens
            self.self_attention.query_chunk_recompute = False
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

        recompute = False  # full recompute: each layer's forward is run again in its backward

        def forward(self, ids, cu):
            from torch.utils.checkpoint import checkpoint

            streams = self.embedding(ids).unsqueeze(-2).expand(-1, n, -1).contiguous()
            for layer in self.layers:
                streams = checkpoint(layer, streams, cu, use_reentrant=False) if self.recompute else layer(streams, cu)
            return self.output_layer(self.final_layernorm(self.hc_head(streams)))

    with torch.device(device):
        return Model()


def _allocated(device) -> int:
    import torch

    return torch.cuda.memory_allocated(device) if str(device).startswith("cuda") else 0


class _Rig:
    """The scaled-down DS4 with its fp32 main gradients, masters and Adam state, built once per device."""

    def __init__(self, shape: Shape, device: str):
        import torch

        self.shape, self.device = shape, device
        torch.manual_seed(0)
        self.base = _allocated(device)
        self.model = build(shape, torch.bfloat16, device)
        self.params = list(self.model.parameters())
        self.main_grads = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        self.masters = [p.detach().float() for p in self.params]
        self.optimizer = torch.optim.Adam(self.masters, lr=1e-5)
        for m in self.masters:  # Adam's moments exist before the step, as after Megatron's first step
            self.optimizer.state[m]["exp_avg"] = torch.zeros_like(m)
            self.optimizer.state[m]["exp_avg_sq"] = torch.zeros_like(m)
            self.optimizer.state[m]["step"] = torch.zeros((), dtype=torch.float32)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            self.states = _allocated(device) - self.base
        else:  # no allocator statistics on a CPU: the tensors' bytes
            tensors = self.params + self.main_grads + self.masters + [v for s in self.optimizer.state.values() for v in s.values()]
            self.states = sum(t.numel() * t.element_size() for t in tensors)


def calibrate(device: str = "cuda", quick: bool = False, tokens: int | None = None, recompute: str = "none", rig: _Rig | None = None) -> dict:
    """One mixed-precision training step of the scaled-down DS4 at ``tokens`` packed rows (two sequences),
    without recompute or with full recompute (``recompute="full"``: every layer checkpointed); measured vs modelled
    bytes. ``rig``: a built model to reuse (``sweep``)."""
    import torch

    from verl_ds4.memory.stages import GIB, Mesh, training_memory

    shape = QUICK if quick else Shape()
    rig = rig or _Rig(shape, device)
    tokens = tokens or shape.tokens
    on_cuda = device.startswith("cuda")
    rig.model.recompute = recompute == "full"
    if on_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    ids = torch.randint(0, shape.vocab_size, (tokens,), device=device)
    cu = torch.tensor([0, tokens // 2, tokens], dtype=torch.int32, device=device)
    t0 = time.perf_counter()
    logits = rig.model(ids, cu)
    loss = torch.nn.functional.cross_entropy(logits.float(), ids.roll(-1))
    loss.backward()
    for p, g in zip(rig.params, rig.main_grads):
        if p.grad is not None:
            g.add_(p.grad.float())
            p.grad = None
    for m, g in zip(rig.masters, rig.main_grads):
        m.grad = g
    rig.optimizer.step()
    with torch.no_grad():
        for p, m in zip(rig.params, rig.masters):
            p.copy_(m.to(p.dtype))
    peak = None
    if on_cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(device) - rig.base
    seconds = time.perf_counter() - t0
    del logits
    sizes = model_sizes(shape)
    stage = training_memory(sizes, Mesh(world=1), tokens_per_gpu=shape.tokens, recompute=frozenset(), micro_batches=1)[0]
    model = modelled_peak(shape, tokens, recompute)
    return {
        "shape": shape, "device": device, "seconds": seconds, "loss": float(loss.detach()), "tokens": tokens, "recompute": recompute,
        "params_built": sum(p.numel() for p in rig.params), "params_model": sizes.total(),
        "states_measured_gib": rig.states / GIB, "states_model_gib": stage.static_gib,
        "states_ratio": rig.states / GIB / stage.static_gib,
        "activations_measured_gib": None if peak is None else (peak - rig.states) / GIB,
        "activations_model_gib": model,
        "peak_measured_gib": None if peak is None else peak / GIB,
        "peak_model_gib": stage.static_gib + model,
    }


def modelled_peak(shape: Shape, tokens: int, recompute: str) -> float:
    """The model's figure above the states for one calibration step (GiB): the larger of the backward's peak
    (verl_ds4/memory/peak.py on the ``reference`` path: the layers' kept tensors, the peak moment, the cross
    entropy's buffers; no allocator margin, since ``max_memory_allocated`` has none) and the optimizer step's
    (torch's foreach Adam allocates ``sqrt(exp_avg_sq)`` for every parameter, 4 bytes each, while this script's
    bf16 logits are still alive)."""
    from verl_ds4.memory.stages import GIB
    from verl_ds4.memory.peak import StepShape, step_peak

    sizes = model_sizes(shape)
    step = step_peak(sizes, list(shape.compress_ratios), path="reference", shape=StepShape(tokens, 1, tokens // 2, shape.window),
                     recompute=None if recompute == "full" else frozenset(), logits="calibration", margin=False)
    backward = step.activations_gib + step.transient_gib
    optimizer_step = (4 * sizes.total() + 2 * sizes.vocab_size * tokens) / GIB
    return max(backward, optimizer_step)


def sweep(device: str, quick: bool, tokens: tuple[int, ...], recomputes: tuple[str, ...] = ("none", "full")) -> list[dict]:
    """``calibrate`` at each token count and recompute on one built model (its states measured once)."""
    rig = _Rig(QUICK if quick else Shape(), device)
    return [calibrate(device, quick, t, r, rig) for t in tokens for r in recomputes]


def summary(r: dict) -> tuple[str, bool, str]:
    """(name, ok, detail) of one calibration for the device check's PASS/FAIL line."""
    s = r["shape"]
    name = (f"memory calibration on {r['device']}: {len(s.compress_ratios)} layers, hidden {s.hidden_size}, "
            f"{s.n_routed_experts} experts, {r['tokens']} tokens, recompute {r['recompute']}")
    ok = r["params_built"] == r["params_model"] and abs(r["states_ratio"] - 1) <= 0.05
    if r["peak_measured_gib"] is not None:  # the step's peak: the model must be within 10% of the allocator's figure
        ok = ok and abs(r["activations_model_gib"] / r["activations_measured_gib"] - 1) <= TOLERANCE
    detail = (f"params built {r['params_built']:,} vs model {r['params_model']:,}; states measured {r['states_measured_gib']:.3f} GiB "
              f"/ model {r['states_model_gib']:.3f} = {r['states_ratio']:.3f}")
    if r["peak_measured_gib"] is not None:
        detail += (f"; activations + transients measured {r['activations_measured_gib']:.2f} GiB, model "
                   f"{r['activations_model_gib']:.2f} (model / measured {r['activations_model_gib'] / r['activations_measured_gib']:.3f}); "
                   f"step peak {r['peak_measured_gib']:.2f} / model {r['peak_model_gib']:.2f} = "
                   f"{r['peak_measured_gib'] / r['peak_model_gib']:.3f}")
    return name, ok, detail + f"; {r['seconds']:.1f} s"


# ---- the committed measurements against the model ------------------------------------------------------------


def model_figure(record: dict) -> float:
    """The model's figure (GiB) for one measurement record of a results file (see ``--compare``)."""
    from verl_ds4.memory.stages import GIB
    from verl_ds4.memory.peak import StepShape, step_peak

    if "mesh" in record:  # a whole model on a mesh (a published run): the stage with the highest peak, margin excluded
        return _mesh_peak(record)
    shape = Shape(**{k: tuple(v) if k == "compress_ratios" else v for k, v in (record.get("shape") or {}).items()})
    tokens, recompute = int(record["tokens"]), record.get("recompute", "none")
    if record["path"] == "reference":
        return modelled_peak(shape, tokens, recompute)
    sizes = model_sizes(shape)
    step = StepShape(tokens, 1, record.get("max_seq_len") or tokens, shape.window)
    if record["quantity"] == "backward_block_gib":  # one allocation of the unfused gather's backward
        ratio = int(record["layer_ratio"])
        return 2 * sizes.head_dim * step.kv_rows(ratio) * tokens / GIB
    rec = {"none": frozenset(), "selective": frozenset({"moe_act", "mhc"}), "full": None}[recompute]
    peak = step_peak(sizes, list(shape.compress_ratios), path=record["path"], shape=step, recompute=rec, margin=False)
    return peak.activations_gib + peak.transient_gib


def _mesh_peak(record: dict) -> float:
    from importlib.resources import files

    import yaml

    from verl_ds4.models.ds4.sizes import DS4Sizes
    from verl_ds4.memory.stages import Mesh, peak_stage, training_memory

    block = yaml.safe_load((files("verl_ds4.configs_data") / "ds4_model" / f"{record['model']}.yaml").read_text())
    sizes = DS4Sizes.from_hf_config({}, record["model"], fallback=block)
    recompute = None if record["recompute"] == "full" else frozenset(record["recompute"])
    stages = training_memory(sizes, Mesh(**record["mesh"]), mtp=record.get("mtp", False), tokens_per_gpu=int(record["tokens"]),
                             path=record["path"], recompute=recompute, max_seq_len=record.get("max_seq_len"), margin=False)
    return peak_stage(stages).peak_gib


def compare(path: str) -> int:
    """Print model vs measured for every record of ``path``; 0 if each is within its tolerance (default 10%)."""
    import json

    data = json.loads(open(path, encoding="utf-8").read())
    print(f"{path}: {data.get('device', '?')}; torch {data.get('torch', '?')}; {data.get('date', '?')}")
    bad = 0
    for r in data["records"]:
        model = model_figure(r)
        ratio = model / r["measured_gib"]
        tol = float(r.get("tolerance", TOLERANCE))
        ok = abs(ratio - 1) <= tol
        bad += not ok
        print(f"  {'ok  ' if ok else 'FAIL'} {r['id']:<34} measured {r['measured_gib']:8.2f} GiB  model {model:8.2f}  "
              f"model/measured {ratio:.3f}  (tolerance {tol:.0%}: {r.get('source', '')})")
    print(f"{len(data['records']) - bad} of {len(data['records'])} within tolerance")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    parser = argparse.ArgumentParser(
        description="Calibrate the memory model (verl_ds4/memory/peak.py) against a device, or compare it with committed "
        "measurements. --compare FILE prints, for each measurement, the model's figure for the same shape, kernel path and "
        "recompute and the ratio; it exits 1 when one is outside its tolerance (10% unless the record states another).")
    parser.add_argument("--compare", metavar="FILE", help="a results file, e.g. benchmarks/results/memory_calibration_h200.json")
    parser.add_argument("--device", default="cuda", help="measure on this device (default cuda)")
    parser.add_argument("--quick", action="store_true", help="tiny widths (the CPU smoke run)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 16384], help="packed tokens per step")
    parser.add_argument("--recompute", nargs="+", choices=("none", "full"), default=["none", "full"])
    parser.add_argument("--json", metavar="OUT", help="also write the measurements as records for --compare")
    args = parser.parse_args(argv)
    if args.compare:
        return compare(args.compare)
    results = sweep(args.device, args.quick, tuple(args.tokens), tuple(args.recompute))
    ok = True
    for r in results:
        name, good, detail = summary(r)
        ok &= good
        print(f"{'PASS' if good else 'FAIL'} {name}: {detail}", flush=True)
    if args.json:
        import dataclasses
        import platform

        import torch

        records = [{"id": f"reference-{r['tokens']}-{r['recompute']}", "path": "reference", "tokens": r["tokens"],
                    "recompute": r["recompute"], "shape": dataclasses.asdict(r["shape"]) if args.quick else {},
                    "quantity": "step_peak_above_states_gib", "measured_gib": round(r["activations_measured_gib"], 3),
                    "states_measured_gib": round(r["states_measured_gib"], 3), "seconds": round(r["seconds"], 2),
                    "source": "benchmarks/gpu/memory_calibration.py"} for r in results if r["peak_measured_gib"] is not None]
        device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": device, "torch": torch.__version__, "python": platform.python_version(),
                       "date": time.strftime("%Y-%m-%d"), "records": records}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.exit(main())
