#!/usr/bin/env python3
"""Activation memory of Megatron-LM dev's own DeepSeek-V4 decoder layers, measured.

Builds Megatron-LM ``dev``'s DS4 layers (``experimental_attention_variant='dsv4_hybrid'``) at
DeepSeek-V4-Flash widths with local (non-TransformerEngine) modules and the unfused PyTorch sparse
attention (``dsa_kernel_backend='none'``), one packed THD micro-batch on one device (world size 1),
and for each layer kind, token count and recompute setting reports:

- ``kept``: bytes still allocated after the training forward (``memory_allocated`` delta: the
  saved activations plus the output);
- ``fwd_peak`` / ``peak``: highest ``max_memory_allocated`` above the states (parameters + their
  preallocated ``.grad``) during the forward, and during forward + backward;
- ``nograd_peak``: the same for a ``torch.no_grad()`` forward (the log-prob / reference pass).

Layer kinds, each its own ``TransformerBlock`` (mHC streams in, HC head + final norm out):
``csa`` (compress ratio 4, indexer top-k), ``hca`` (ratio 128), ``pair`` (the two chained).
An out-of-memory case is reported as a lower bound (``oom: true``; the bytes held when it failed
plus the request the allocator refused).

Megatron is not installed on the device machine: this script imports the ``megatron/core`` tree that
``benchmarks/gpu/prepare_megatron_dev.sh`` exports into ``benchmarks/gpu/carry/megatron_dev`` (carry
that path). If ``fast_hadamard_transform`` is missing, the indexer's Hadamard rotation is replaced
by a pure-PyTorch stand-in (an exact +-1 matrix product that saves nothing for backward); the
output says which one ran.

    python benchmarks/gpu/megatron_dsv4_memory.py                  # H200: 2k/4k/8k, none + selective
    python benchmarks/gpu/megatron_dsv4_memory.py --tokens 16384 --kinds pair --recompute none  # the OOM
    python benchmarks/gpu/megatron_dsv4_memory.py --device cpu --quick   # tiny widths smoke test
    python benchmarks/gpu/megatron_dsv4_memory.py --kinds pair --recompute none --attention megatron,linear \
        --tokens 2048,8192,16384,32768 --records linear.json          # dev's unfused core vs verl-ds4's linear one

``--attention linear`` measures the same layers with verl-ds4's memory-linear sparse attention in place of dev's
unfused functions (verl_ds4.mcore.sparse_attention_patch, which first checks they are the ones it was proven
against).
"""

import argparse
import contextlib
import gc
import json
import os
import re
import socket
import sys
import time
from pathlib import Path

import torch
import torch._dynamo

HERE = Path(__file__).resolve().parent
GIB = 1024**3

# DeepSeek-V4-Flash widths (config.json as quoted in docs/ds4-context-parallel.md section 11) with
# the experts cut to 16 so two layers fit one device; ``--quick`` is a CPU smoke-test size.
FLASH = dict(hidden=4096, heads=64, head_dim=512, rope_dim=64, q_lora=1024, o_groups=8,
             o_lora=1024, idx_heads=64, idx_dim=128, topk=512, window=128, experts=16,
             router_topk=6, expert_ffn=2048, shared_ffn=2048, streams=4)
QUICK = dict(hidden=256, heads=4, head_dim=64, rope_dim=32, q_lora=64, o_groups=2,
             o_lora=64, idx_heads=4, idx_dim=64, topk=16, window=128, experts=4,
             router_topk=2, expert_ffn=128, shared_ffn=128, streams=4)
KINDS = {"csa": [4], "hca": [128], "pair": [4, 128]}
RECOMPUTE = {"none": None, "selective": ["moe_act", "mhc"]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny widths and token counts (CPU smoke)")
    p.add_argument("--tokens", default=None,
                   help="comma-separated packed token counts (default 2048,4096,8192; quick 256,512)")
    p.add_argument("--seq-len", type=int, default=0,
                   help="pack sequences of this length (0 = one sequence of all the tokens)")
    p.add_argument("--kinds", default="csa,hca,pair", help=f"subset of {','.join(KINDS)}")
    p.add_argument("--recompute", default="none,selective", help=f"subset of {','.join(RECOMPUTE)}")
    p.add_argument("--attention", default="megatron",
                   help="comma-separated sparse-attention cores: megatron (dev's unfused_compressed_sparse_attn) "
                        "and/or linear (verl_ds4.kernels, installed by verl_ds4.mcore.sparse_attention_patch)")
    p.add_argument("--indexer-loss-coeff", type=float, default=0.0)
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                   help="Megatron's torch.compile'd mHC helpers (auto: on for cuda, off for cpu)")
    p.add_argument("--budget-s", type=float, default=170.0,
                   help="skip the remaining cases once this many seconds have passed")
    p.add_argument("--megatron", default=str(HERE / "carry" / "megatron_dev"),
                   help="folder holding megatron/core (prepare_megatron_dev.sh)")
    p.add_argument("--records", default=None,
                   help="also write the pair / no-recompute rows as memory_calibration.py --compare records "
                        "(path unfused for megatron, linear for linear; OOM rows left out) to this JSON file")
    p.add_argument("--out", default=None,
                   help="JSON path (default $OUT/megatron_dsv4_memory.json, else ./megatron_dsv4_memory.json)")
    args = p.parse_args(argv)
    args.kinds = [k for k in args.kinds.split(",") if k]
    args.attention = [a for a in args.attention.split(",") if a]
    bad = [a for a in args.attention if a not in ("megatron", "linear")]
    if bad:
        p.error(f"--attention: unknown {bad}; choose from megatron, linear")
    args.recompute = [r for r in args.recompute.split(",") if r]
    for name, allowed, given in (("--kinds", KINDS, args.kinds), ("--recompute", RECOMPUTE, args.recompute)):
        bad = [g for g in given if g not in allowed]
        if bad:
            p.error(f"{name}: unknown {bad}; expected a comma-separated subset of {sorted(allowed)}")
    default_tokens = "256,512" if args.quick else "2048,4096,8192"
    args.tokens = [int(t) for t in (args.tokens or default_tokens).split(",") if t]
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here; pass --device cpu (with --quick) for a smoke test")
    return args


# ---------------------------------------------------------------- environment shims (our own code)

MEGATRON_MODULES = (
    "megatron.core.parallel_state", "megatron.core.tensor_parallel.random",
    "megatron.core.models.backends", "megatron.core.packed_seq_params",
    "megatron.core.models.gpt.experimental_attention_variant_module_specs",
    "megatron.core.transformer.transformer_block", "megatron.core.transformer.transformer_config",
    "megatron.core.transformer.experimental_attention_variant.dsa",
    "megatron.core.transformer.experimental_attention_variant.deepseek_v4_hybrid_attention",
)


def import_megatron(device):
    """Import the megatron modules this script uses. CPU smoke only: dev's megatron/core imports
    triton at module level (MoE paged stash, CSA teacher LSE) though the CPU path never launches
    those kernels, so a no-op ``triton`` is visible during the import and removed right after
    (verl_ds4.substitutes.imports). Returns whether it was used."""
    import importlib
    import importlib.util
    stub = device == "cpu" and importlib.util.find_spec("triton") is None
    stand_in = _substitutes("imports").triton_stand_in() if stub else contextlib.nullcontext()
    with stand_in:
        for name in MEGATRON_MODULES:
            importlib.import_module(name)
    return stub


def _substitutes(module):
    """``verl_ds4.substitutes.<module>`` (the repository's root put on sys.path: the device machine runs this file
    from a copy of the tree, without installing the package)."""
    import importlib
    if str(HERE.parents[1]) not in sys.path:
        sys.path.insert(0, str(HERE.parents[1]))
    return importlib.import_module(f"verl_ds4.substitutes.{module}")


class _Hadamard(torch.autograd.Function):
    """y = x H * scale with the Sylvester +-1 matrix; H is symmetric, so backward is the same map.
    Saves nothing for backward, like fast_hadamard_transform's kernel."""

    _cache = {}

    @staticmethod
    def matrix(n, dtype, device):
        key = (n, dtype, str(device))
        if key not in _Hadamard._cache:
            _Hadamard._cache[key] = _substitutes("hadamard").hadamard_matrix(n, dtype, device)
        return _Hadamard._cache[key]

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return (x @ _Hadamard.matrix(x.shape[-1], x.dtype, x.device)) * scale

    @staticmethod
    def backward(ctx, grad):
        return (grad @ _Hadamard.matrix(grad.shape[-1], grad.dtype, grad.device)) * ctx.scale, None


def install_hadamard():
    """Use fast_hadamard_transform when importable, else the stand-in. Returns the one in use."""
    from megatron.core.transformer.experimental_attention_variant import dsa
    if dsa.hadamard_transform is not None:
        return "fast_hadamard_transform"
    dsa.hadamard_transform = lambda x, scale=1.0: _Hadamard.apply(x, scale)
    return "pure-PyTorch stand-in (Sylvester matrix product, saves nothing)"


def local_backend():
    """Megatron's local backend with a replicated linear for the DS4 spec's ``backend.linear()`` slots (TE's
    ``TELinear`` with ``parallel_mode='duplicated'`` upstream): verl_ds4.substitutes.te_local's."""
    return _substitutes("te_local").CPUSpecProvider()


def install_cpu_shims():
    """CPU smoke only: DS4 code creates two parameters on ``torch.cuda.current_device()``, mHC
    opens ``torch.cuda.nvtx`` ranges and Megatron's checkpointing saves the CUDA RNG state, all
    unconditionally; each fails on a CPU-only torch."""
    from megatron.core.tensor_parallel import random as mrandom
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.nvtx.range_push = lambda *a, **k: None
    torch.cuda.nvtx.range_pop = lambda *a, **k: None


def probe_compile(device):
    """Megatron's mHC helpers are torch.compile'd; a machine without a working inductor toolchain
    (no C compiler for triton's launcher, say) would fail mid-run. Try once; fall back to eager."""
    try:
        f = torch.compile(lambda a: a * 2 + 1)
        f(torch.ones(8, device=device)).sum().item()
        return True, None
    except Exception as err:  # noqa: BLE001  (any compile failure means: run eager)
        torch._dynamo.reset()
        return False, f"compile probe failed, ran eager: {type(err).__name__}: {str(err)[:160]}"


def init_distributed(device):
    import megatron.core.parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group(
        "nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
        world_size=1, rank=0)
    ps.initialize_model_parallel(1, 1)
    if device == "cuda":
        model_parallel_cuda_manual_seed(1234)
    else:
        torch.manual_seed(1234)


# ---------------------------------------------------------------- model

def make_config(w, ratios, recompute_modules, device, loss_coeff):
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    rec = {} if recompute_modules is None else dict(
        recompute_granularity="selective", recompute_modules=list(recompute_modules))
    return MLATransformerConfig(
        num_layers=len(ratios), hidden_size=w["hidden"], num_attention_heads=w["heads"],
        use_cpu_initialization=(device == "cpu"), bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, add_bias_linear=False, normalization="RMSNorm",
        multi_latent_attention=True, q_lora_rank=w["q_lora"],
        kv_lora_rank=w["head_dim"] - w["rope_dim"], qk_head_dim=w["head_dim"] - w["rope_dim"],
        qk_pos_emb_head_dim=w["rope_dim"], v_head_dim=w["head_dim"], o_groups=w["o_groups"],
        o_lora_rank=w["o_lora"], rope_type="rope", rotary_base=10000, rotary_percent=1.0,
        experimental_attention_variant="dsv4_hybrid", csa_compress_ratios=list(ratios),
        csa_window_size=w["window"], dsa_indexer_n_heads=w["idx_heads"],
        dsa_indexer_head_dim=w["idx_dim"], dsa_indexer_topk=w["topk"],
        dsa_indexer_loss_coeff=loss_coeff, dsa_kernel_backend="none",
        enable_hyper_connections=True, num_residual_streams=w["streams"],
        num_moe_experts=w["experts"], moe_router_topk=w["router_topk"],
        moe_ffn_hidden_size=w["expert_ffn"], ffn_hidden_size=w["expert_ffn"],
        moe_shared_expert_intermediate_size=w["shared_ffn"], moe_grouped_gemm=True,
        moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        hidden_dropout=0.0, attention_dropout=0.0, **rec)


def build_block(config, device):
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_layer_with_experimental_attention_variant_spec)
    from megatron.core.transformer import transformer_block as tb
    from megatron.core.transformer.experimental_attention_variant import (
        deepseek_v4_hybrid_attention as dha)
    backend = local_backend()
    dha.TELinear = backend.linear()  # the spec's q_down_proj check compares against this name
    specs = get_transformer_layer_with_experimental_attention_variant_spec(config, backend=backend)
    spec = tb.TransformerBlockSubmodules(layer_specs=specs, layer_norm=backend.layer_norm(rms_norm=True))
    block = tb.TransformerBlock(config, spec).to(device)
    for p in block.parameters():  # grads preallocated: they are states, not activations
        p.grad = torch.zeros_like(p)
    return block


def packed(tokens, seq_len, device):
    from megatron.core.packed_seq_params import PackedSeqParams
    seq_len = seq_len or tokens
    lens = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                           max_seqlen_q=max(lens), max_seqlen_kv=max(lens))


# ---------------------------------------------------------------- measurement

class Meter:
    """CUDA: the caching allocator's counters. CPU: counters are not available (reported as None)."""

    def __init__(self, device):
        self.cuda = device == "cuda"

    def now(self):
        return torch.cuda.memory_allocated() if self.cuda else None

    def reset(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def peak(self):
        if not self.cuda:
            return None
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()


def _requested(err):
    m = re.search(r"Tried to allocate ([0-9.]+) (B|KiB|MiB|GiB|TiB)", str(err))
    if not m:
        return 0
    return int(float(m.group(1)) * 1024 ** ["B", "KiB", "MiB", "GiB", "TiB"].index(m.group(2)))


class SavedBytes:
    """Bytes autograd saves for backward, by distinct storage, parameters left out (works on CPU)."""

    def __init__(self, params):
        self.params = {(p.device.type, p.untyped_storage().data_ptr()) for p in params}
        self.storages = {}

    def pack(self, t):
        st = t.untyped_storage()
        key = (st.device.type, st.data_ptr())
        if key not in self.params:
            self.storages[key] = st.nbytes()
        return t

    def total(self):
        return sum(self.storages.values())


def measure(block, tokens, seq_len, w, device, meter):
    psp = packed(tokens, seq_len, device)
    row = {"tokens": tokens, "oom": False}
    x = torch.randn(tokens, 1, w["hidden"], device=device, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_(True)
    saved = SavedBytes(block.parameters())
    base = meter.now()
    phase = "nograd"
    t0 = time.time()
    try:
        block.train()
        meter.reset()
        with torch.no_grad():
            out = block(x, attention_mask=None, packed_seq_params=psp)
        row["nograd_peak"] = None if base is None else meter.peak() - base
        del out
        phase = "forward"
        meter.reset()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            out = block(xg, attention_mask=None, packed_seq_params=psp)
        row["saved"] = saved.total()
        row["fwd_peak"] = None if base is None else meter.peak() - base
        row["kept"] = None if base is None else meter.now() - base
        phase = "backward"
        grad = torch.randn_like(out)
        if device == "cpu":  # no allocator counters: the profiler names the largest backward blocks
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                out.backward(grad)
            gathers = [e.cpu_memory_usage for e in prof.events() if e.name == "aten::gather_backward"]
            row["cpu_gather_bwd_allocs"] = sorted(gathers, reverse=True)
        else:
            out.backward(grad)
        row["peak"] = None if base is None else max(meter.peak() - base, row["fwd_peak"])
        del out
    except torch.OutOfMemoryError as err:
        held = meter.now()
        row.update(oom=True, oom_phase=phase,
                   lower_bound=(held - base) + _requested(err), refused=_requested(err))
    row["seconds"] = round(time.time() - t0, 2)
    del x, xg, saved
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def gather_backward_bytes(tokens, seq_len, ratios, w):
    """The unfused attention's largest backward block, by reading the code: ``torch.gather`` on
    ``kv_full.unsqueeze(0).expand(T, -1, -1)`` has a backward that allocates the expanded shape,
    ``[T, T + compressed rows, head_dim]`` in bf16, per layer (the largest layer of the block)."""
    seq_len = seq_len or tokens
    lens = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
    return max(tokens * (tokens + (sum(n // r for n in lens) if r > 1 else 0)) * w["head_dim"] * 2
               for r in ratios)


def fmt(v):
    return "    n/a" if v is None else f"{v / GIB:7.3f}"


def main(argv=None):
    args = parse_args(argv)
    megatron = Path(args.megatron)
    if not (megatron / "megatron" / "core").is_dir():
        sys.exit(f"megatron_dsv4_memory: no megatron/core under {megatron}; run "
                 "benchmarks/gpu/prepare_megatron_dev.sh first (and carry benchmarks/gpu/carry)")
    sys.path.insert(0, str(megatron))
    triton_stub = import_megatron(args.device)
    if args.device == "cpu":
        install_cpu_shims()
    commit_file = megatron / "COMMIT"
    commit = commit_file.read_text().strip() if commit_file.exists() else "unknown"
    compiled = args.compile == "on" or (args.compile == "auto" and args.device == "cuda")
    compile_note = None
    if compiled and args.compile == "auto":
        compiled, compile_note = probe_compile(args.device)
    if not compiled:
        torch._dynamo.config.disable = True
    init_distributed(args.device)
    hadamard = install_hadamard()
    w = QUICK if args.quick else FLASH
    meter = Meter(args.device)
    info = {"megatron_commit": commit, "hadamard": hadamard, "triton_stub": triton_stub,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "torch": torch.__version__, "widths": w, "seq_len": args.seq_len or "tokens",
            "indexer_loss_coeff": args.indexer_loss_coeff, "torch_compile": compiled,
            "compile_note": compile_note,
            "notes": ["experts are local SequentialMLP: 'moe_act' recompute is accepted but inert",
                      "states = parameters + preallocated .grad; every byte figure is above them",
                      "saved = distinct non-parameter storages autograd saved in the training forward",
                      "kept also holds the block output; peak includes the output gradient",
                      "gather_bwd = T x (T + compressed rows) x head_dim x 2 bytes, read from the code"],
            "skipped": []}
    print(f"megatron dev {commit[:10]}; hadamard: {hadamard}; device {info['device']}; "
          f"torch.compile {'on' if compiled else 'off'}"
          + (f" ({compile_note})" if compile_note else "")
          + ("; triton stubbed (CPU)" if triton_stub else ""), flush=True)
    if args.device == "cpu":
        print("CPU: the allocator counters exist only on CUDA, so byte columns print n/a", flush=True)
    rows = []
    t_all = time.time()
    for attention in args.attention:
        patch = _attention_core(attention, info)
        try:
            _measure_all(args, attention, w, meter, info, rows, t_all)
        finally:
            if patch is not None:
                patch.uninstall()
    info["seconds"] = round(time.time() - t_all, 1)
    out = Path(args.out) if args.out else Path(os.environ.get("OUT", ".")) / "megatron_dsv4_memory.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    print(f"wrote {out} ({info['seconds']} s)")
    if args.records:
        write_records(args.records, info, rows)
    torch.distributed.destroy_process_group()


#: memory_calibration.py's kernel path of each --attention choice.
RECORD_PATH = {"megatron": "unfused", "linear": "linear"}


def write_records(path, info, rows):
    """The two-layer (pair), no-recompute measurements as memory_calibration.py --compare records."""
    records = [{"id": f"megatron-{RECORD_PATH[r['attention']]}-{r['tokens']}-none", "path": RECORD_PATH[r["attention"]],
                "tokens": r["tokens"], "recompute": "none", "quantity": "fwd_bwd_peak_above_states_gib",
                "measured_gib": round(r["peak"] / GIB, 3),
                "source": f"Megatron-LM dev layers ({info['megatron_commit'][:10]}), --attention {r['attention']}, "
                          f"indexer loss coeff {info['indexer_loss_coeff']}"}
               for r in rows
               if r["kind"] == "pair" and r["recompute"] == "none" and not r["oom"] and r.get("peak") is not None]  # fmt: skip
    Path(path).write_text(json.dumps({"device": info["device"], "torch": info["torch"], "date": time.strftime("%Y-%m-%d"),
                                      "provenance": "benchmarks/gpu/megatron_dsv4_memory.py --records",
                                      "records": records}, indent=1))  # fmt: skip
    print(f"wrote {len(records)} records to {path} (memory_calibration.py --compare {path})")


def _attention_core(attention, info):
    """``linear``: verl-ds4's memory-linear core replaces dev's unfused functions (the patch module, or None)."""
    if attention != "linear":
        return None
    sys.path.insert(0, str(HERE.parents[1]))
    from megatron.core.transformer.experimental_attention_variant import csa

    from verl_ds4.mcore import sparse_attention_patch

    info.setdefault("linear_core", sparse_attention_patch.install(csa))
    print(f"attention core: linear (verl_ds4.kernels) in place of dev's {', '.join(info['linear_core'])}", flush=True)
    return sparse_attention_patch


def _measure_all(args, attention, w, meter, info, rows, t_all):
    for rc in args.recompute:  # every kind without recompute first: the budget cuts selective first
        for kind in args.kinds:
            if time.time() - t_all > args.budget_s:
                info["skipped"].append(f"{attention}/{kind}/{rc}")
                print(f"{kind:4s} {rc:9s} skipped: past --budget-s {args.budget_s:.0f}", flush=True)
                continue
            config = make_config(w, KINDS[kind], RECOMPUTE[rc], args.device, args.indexer_loss_coeff)
            block = build_block(config, args.device)
            states = meter.now()
            nparams = sum(p.numel() for p in block.parameters())
            print(f"{kind:4s} {rc:9s} ratios {KINDS[kind]}: {nparams:,} parameters; states "
                  f"{fmt(states)} GiB (parameters + grads)", flush=True)
            for tokens in args.tokens:
                if time.time() - t_all > args.budget_s:
                    info["skipped"].append(f"{attention}/{kind}/{rc}/{tokens}")
                    print(f"{kind:4s} {rc:9s} T={tokens:6d}  skipped: past --budget-s", flush=True)
                    continue
                row = dict(kind=kind, recompute=rc, attention=attention, states=states,
                           gather_bwd=gather_backward_bytes(tokens, args.seq_len, KINDS[kind], w) if attention == "megatron" else 0,
                           **measure(block, tokens, args.seq_len, w, args.device, meter))
                rows.append(row)
                if row["oom"]:
                    print(f"{attention:8s} {kind:4s} {rc:9s} T={tokens:6d}  OOM in {row['oom_phase']}: needs >= "
                          f"{fmt(row['lower_bound'])} GiB above states (refused "
                          f"{fmt(row['refused'])} GiB)  {row['seconds']}s", flush=True)
                else:
                    print(f"{attention:8s} {kind:4s} {rc:9s} T={tokens:6d}  saved {fmt(row['saved'])}  kept "
                          f"{fmt(row['kept'])}  gather_bwd {fmt(row['gather_bwd'])}  fwd_peak "
                          f"{fmt(row['fwd_peak'])}  peak {fmt(row['peak'])}  nograd_peak "
                          f"{fmt(row['nograd_peak'])} GiB  {row['seconds']}s", flush=True)
            del block
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
