"""Numerical checks of this repository's pure-PyTorch DS4 pieces on a device, against CPU fp64.

Needs torch (and numpy) only: it imports ``verl_ds4.models.ds4.attention`` (which pulls
``verl_ds4.ds4_facts``, ``.cp_comm`` and ``.rope``: standard library and torch), never verl,
Megatron or TransformerEngine; ``--help`` and the checks refuse to start if one of those got imported.

Checks (``--checks``; each prints one ``PASS``/``FAIL`` line and its numbers):

* ``attention``: ``DS4HybridAttention`` of the three DS4 kinds (sliding window, CSA with the
  indexer's top-k, HCA), tiny sizes, ragged packed sequences; forward and backward (input and every
  parameter gradient) in bf16 and fp32 on the device against the same weights in fp64 on the CPU.
  Reported: the relative error ||device - ref|| / ||ref|| of the output and the worst gradient.
  For bf16 the top-k keeps every compressed block (a bf16 near-tie may pick another block, which
  is a different function, not an error); fp32 also runs a case with a small top-k.

* ``memory``: the memory model's calibration (``memory_calibration.py``): a scaled-down DS4 at
  Flash's widths (2 layers, 16 experts) takes one mixed-precision training step; the bytes of its
  states and the step's peak against verl_ds4/memory/stages.py's figures, as ratios.

A later check (e.g. the DS4 model) is one more function registered in ``CHECKS``: it takes the
device and returns ``CheckResult``s.

    python benchmarks/gpu/device_checks.py --device cuda              # all checks
    python benchmarks/gpu/device_checks.py --device cpu --quick     # the CPU smoke run
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# Packages the device machine does not have; importing any of them is a bug of this script.
FORBIDDEN_IMPORTS = ("verl", "megatron", "transformer_engine", "ray", "vllm")

# Relative-error limits (output, worst gradient) per dtype. fp32 against fp64 on tiny shapes is at
# ~1e-6; bf16 (8 mantissa bits, rounding after every matmul and norm) at ~1e-2.
TOLERANCE = {"float32": (1e-4, 1e-4), "bfloat16": (6e-2, 8e-2)}
# Ragged packed sequences: shorter than the window, several windows, not multiples of 4, HCA blocks.
LENGTHS = [5, 13, 40, 131, 300]
QUICK_LENGTHS = [5, 13, 40]  # --quick (the CPU smoke run): the same code paths, less work


@dataclass
class CheckResult:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'} {self.name}: {self.detail}"


def forbidden_modules_loaded(allowed=()) -> list[str]:
    forbidden = set(FORBIDDEN_IMPORTS) - set(allowed)
    return sorted({m.split(".")[0] for m in sys.modules if m.split(".")[0] in forbidden})


def _spec(kind: str, topk: int):
    from verl_ds4.models.ds4.attention import DS4AttentionSpec

    ratio = {"swa": 0, "csa": 4, "hca": 16}[kind]
    return DS4AttentionSpec(
        hidden_size=48, num_heads=4, head_dim=32, rope_dim=8, q_lora_rank=24, o_groups=2, o_lora_rank=12,
        compress_ratio=ratio, window_size=16, index_n_heads=2, index_head_dim=16, index_topk=topk,
        rope_theta=10000.0, compress_rope_theta=40000.0, yarn_factor=16.0,
        yarn_original_max_position_embeddings=256,
    )


def _rel(a, b) -> float:
    import torch

    a, b = a.detach().to(torch.float64).cpu(), b.detach().to(torch.float64).cpu()
    if not torch.isfinite(a).all():
        return float("inf")
    denom = b.norm().item()
    return (a - b).norm().item() / denom if denom > 0 else (a - b).norm().item()


def _forward_backward(module, x, cu, weight):
    out = module(x, cu)
    (out.to(weight.dtype) * weight).sum().backward()
    grads = {"input": x.grad}
    grads.update({name: p.grad for name, p in module.named_parameters()})
    return out, grads


def attention_case(kind: str, dtype_name: str, device: str, topk: int, seed: int = 0,
                   lengths: list[int] = LENGTHS) -> CheckResult:
    import torch

    from verl_ds4.models.ds4.attention import DS4HybridAttention

    dtype = getattr(torch, dtype_name)
    spec = _spec(kind, topk)
    torch.manual_seed(seed)
    ref = DS4HybridAttention(spec, dtype=torch.float64)
    with torch.no_grad():  # non-trivial norms and sinks, so their gradients are not degenerate
        for name, p in ref.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    lengths = torch.tensor(lengths)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32)
    rows = int(cu[-1])
    x64 = torch.randn(rows, spec.hidden_size, dtype=torch.float64)
    w64 = torch.randn(rows, spec.hidden_size, dtype=torch.float64)

    x_ref = x64.clone().requires_grad_(True)
    out_ref, g_ref = _forward_backward(ref, x_ref, cu, w64)

    dev = DS4HybridAttention(spec, dtype=dtype)
    dev.load_state_dict({k: v.to(dtype) for k, v in ref.state_dict().items()})
    dev = dev.to(device)
    x_dev = x64.to(device=device, dtype=dtype).requires_grad_(True)
    t0 = time.perf_counter()
    out_dev, g_dev = _forward_backward(dev, x_dev, cu.to(device), w64.to(device=device, dtype=torch.float32))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3

    name = f"attention {kind} {dtype_name} topk={topk} on {device}"
    missing = sorted(k for k, g in g_dev.items() if g is None and g_ref.get(k) is not None)
    if missing:
        return CheckResult(name, False, f"no gradient on the device for {missing}")
    if out_dev.device.type != torch.device(device).type:
        return CheckResult(name, False, f"output on {out_dev.device}, expected {device}")
    out_err = _rel(out_dev, out_ref)
    grad_errs = {k: _rel(g_dev[k], g_ref[k]) for k in g_ref if g_ref[k] is not None}
    worst = max(grad_errs, key=grad_errs.get)
    out_tol, grad_tol = TOLERANCE[dtype_name]
    ok = out_err <= out_tol and grad_errs[worst] <= grad_tol
    detail = (f"out rel err {out_err:.2e} (<= {out_tol:.0e}), worst grad {worst} {grad_errs[worst]:.2e} "
              f"(<= {grad_tol:.0e}), input grad {grad_errs['input']:.2e}, {rows} rows, fwd+bwd {ms:.1f} ms")
    return CheckResult(name, ok, detail)


def check_attention(device: str, quick: bool = False) -> list[CheckResult]:
    # CSA top-k: 4 of ~122 compressed blocks (fp32 only) and every block (both dtypes).
    lengths = QUICK_LENGTHS if quick else LENGTHS
    all_blocks = max(lengths)
    if quick:
        cases = [("swa", "float32", all_blocks), ("csa", "float32", 4), ("hca", "bfloat16", all_blocks)]
    else:
        cases = [(kind, "float32", all_blocks) for kind in ("swa", "csa", "hca")]
        cases.append(("csa", "float32", 4))
        cases += [(kind, "bfloat16", all_blocks) for kind in ("swa", "csa", "hca")]
    results = []
    for kind, dtype_name, topk in cases:
        try:
            results.append(attention_case(kind, dtype_name, device, topk, lengths=lengths))
        except Exception as e:  # one failing case must not hide the others
            results.append(CheckResult(f"attention {kind} {dtype_name} topk={topk} on {device}", False,
                                       f"{type(e).__name__}: {e}"))
    return results


# name -> function(device, quick) -> list[CheckResult]. A model check is added here.
def check_memory(device: str, quick: bool = False) -> list[CheckResult]:
    """The memory model's calibration (benchmarks/gpu/memory_calibration.py): one training step of a
    scaled-down DS4 at Flash's widths, allocated bytes against the model's figures."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from memory_calibration import calibrate, summary

    name, ok, detail = summary(calibrate(device, quick=quick))
    return [CheckResult(name, ok, detail)]


def check_ds4(device: str, quick: bool = False) -> list[CheckResult]:
    """The whole tiny DS4 (model_checks.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from model_checks import check_ds4 as run

    return run(device, quick=quick)


def check_ds41(device: str, quick: bool = False) -> list[CheckResult]:
    """The whole tiny V4.1 in Megatron-Core (model_checks.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from model_checks import check_ds41 as run

    return run(device, quick=quick)


CHECKS = {
    "attention": check_attention,
    "memory": check_memory,
    "ds4": check_ds4,
    "ds41": check_ds41,
}
# What a check may import beyond torch: the whole models are Megatron-Core models (megatron-core is
# carried to the GPU machine as a wheel); nothing may import verl, Ray, TransformerEngine or vLLM.
ALLOWED_IMPORTS = {"ds4": ("megatron",), "ds41": ("megatron",)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (the smoke run)")
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated, of: {', '.join(CHECKS)}")
    parser.add_argument("--quick", action="store_true", help="fewer, shorter cases (the CPU smoke run)")
    parser.add_argument("--results", type=Path, help="also append the PASS/FAIL lines to this file")
    args = parser.parse_args(argv)

    import torch

    names = [c for c in args.checks.split(",") if c]
    unknown = [c for c in names if c not in CHECKS]
    if unknown:
        parser.error(f"unknown checks {unknown}; known: {', '.join(CHECKS)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("device_checks: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"device_checks: torch {torch.__version__} on {where}")
    results = []
    for name in names:
        try:
            results += CHECKS[name](args.device, quick=args.quick)
        except Exception as e:  # one failing check must not hide the others
            results.append(CheckResult(name, False, f"{type(e).__name__}: {e}"))
    leaked = forbidden_modules_loaded(allowed={m for n in names for m in ALLOWED_IMPORTS.get(n, ())})
    if leaked:
        results.append(CheckResult("imports", False, f"imported {leaked}, which the device machine lacks"))
    lines = [r.line() for r in results]
    print("\n".join(lines))
    if args.results:
        with args.results.open("a") as f:
            f.write("\n".join(lines) + "\n")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
