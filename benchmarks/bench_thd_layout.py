"""THD pre/post-processing: verl_ds4 against verl 0.9.1, side by side, in one process.

For B sequences of 64-512 tokens, CP 4 and 8, both layouts, it times on one CP rank:

* preprocess: ``preprocess_thd_engine`` (plan + packed ids + position ids + PackedSeqParams)
* postprocess: ``postprocess_thd_engine`` on a ``[1, local_rows]`` output
* the copy limit: one raw ``index_select`` of the same number of rows

and prints times and ratios. On the CPU, glibc's malloc hands freed memory back to the OS
depending on the history of earlier allocations (its thresholds adapt), so the same call then
page-faults its fresh tensors in again: 200-350 faults per call at B=4096, and times that change
by 2-5x between runs of the same cell. The benchmark fixes malloc's thresholds at start-up
(``mallopt``, see :func:`fix_malloc_thresholds`; ``--no-fixed-malloc`` turns it off) and releases
the previous call's outputs before each timed call; this applies to verl, verl_ds4 and the copy
alike, and is what PyTorch's caching allocator does on CUDA anyway. Both implementations run under the same stand-ins: Megatron's
parallel-state getters report the chosen tp/cp/rank, and ``torch.distributed.all_gather`` copies
the local shard into every slot (one process cannot all-gather; the real collective is exercised
by the tests). megatron-core 0.16.1 lacks ``PackedSeqParams.cp_partition_mode``, so the field is
emulated for both (see ``verl_ds4.testing.megatron_compat``).

    python benchmarks/bench_thd_layout.py                 # full table (verl's B=4096 takes minutes)
    python benchmarks/bench_thd_layout.py --batches 64 256 --cp 4
    python benchmarks/bench_thd_layout.py --device cuda   # where a GPU is present
    python benchmarks/bench_thd_layout.py --device cuda --without-verl   # GPU machine without verl installed
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import warnings

import torch


def fix_malloc_thresholds() -> bool:
    """Fixed glibc malloc thresholds: freed memory stays in the process (no trim / re-fault churn).

    Returns False where this is not glibc (nothing changes then).
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum on 64-bit
        return bool(ok and libc.mallopt(m_trim_threshold, 1 << 30))
    except (OSError, AttributeError):
        return False


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256, 1024, 4096], help="sequences per micro-batch")
    p.add_argument("--cp", type=int, nargs="+", default=[4, 8], help="context-parallel sizes")
    p.add_argument("--layouts", nargs="+", default=["zigzag", "contiguous"], choices=["zigzag", "contiguous"])
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=50, help="timed repeats of verl_ds4 and the copy (best is reported)")
    p.add_argument(
        "--verl-budget-s", type=float, default=2.0, help="repeat verl only while one call is faster than this"
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--without-verl",
        action="store_true",
        help="time verl_ds4 and the copy only (for a machine where verl is not installed, e.g. a bare GPU box)",
    )
    p.add_argument(
        "--no-fixed-malloc", dest="fixed_malloc", action="store_false", help="keep glibc's adaptive malloc thresholds"
    )
    return p.parse_args(argv)


@contextlib.contextmanager
def fake_parallel_state(tp: int, cp: int, rank: int):
    """Megatron and torch.distributed getters report (tp, cp, rank); all_gather replicates the local shard."""
    from megatron.core import parallel_state as mpu

    saved = {}
    patches = {
        "get_tensor_model_parallel_world_size": lambda *a, **k: tp,
        "get_context_parallel_world_size": lambda *a, **k: cp,
        "get_context_parallel_rank": lambda *a, **k: rank,
        "get_context_parallel_group": lambda *a, **k: None,
    }
    for name, fn in patches.items():
        saved[name] = getattr(mpu, name)
        setattr(mpu, name, fn)
    dist = torch.distributed
    saved_dist = {name: getattr(dist, name) for name in ("all_gather", "get_world_size", "get_rank")}

    def local_all_gather(tensor_list, tensor, group=None, async_op=False):
        for t in tensor_list:
            t.copy_(tensor)

    dist.all_gather = local_all_gather
    dist.get_world_size = lambda group=None: cp
    dist.get_rank = lambda group=None: rank
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(mpu, name, fn)
        for name, fn in saved_dist.items():
            setattr(dist, name, fn)


def timed(fn, repeats: int, device: str, budget_s: float | None = None) -> tuple[float, object]:
    """Best wall time in ms over ``repeats`` calls (stops early once a call exceeds ``budget_s``)."""
    best, result = float("inf"), None
    for _ in range(max(1, repeats)):
        result = None  # release the previous call's outputs first (see the module docstring)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        elapsed = (time.perf_counter() - t0) * 1e3
        best = min(best, elapsed)
        if budget_s is not None and elapsed > budget_s * 1e3:
            break
    return best, result


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    from verl_ds4.mcore import thd as ours
    from verl_ds4.testing.megatron_compat import emulate_cp_partition_mode_field

    verl_util = None
    if not args.without_verl:
        import verl.models.mcore.util as verl_util
    emulate_cp_partition_mode_field(include_verl=verl_util is not None)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("--device cuda requested but no CUDA device is available", file=sys.stderr)
        return 2
    torch.set_num_threads(max(1, torch.get_num_threads()))
    gen = torch.Generator().manual_seed(args.seed)
    header = (
        f"{'B':>5} {'cp':>3} {'layout':>10} | {'verl pre':>10} {'ours pre':>9} {'x faster':>9} {'copy':>8} "
        f"{'ours/copy':>9} | {'verl post':>10} {'ours post':>9} {'x faster':>9}"
    )
    malloc = "fixed thresholds" if args.fixed_malloc and fix_malloc_thresholds() else "glibc defaults"
    print(
        f"device={args.device} torch={torch.__version__} threads={torch.get_num_threads()} "
        f"lengths {args.min_len}-{args.max_len} malloc={malloc}"
    )
    print("times in ms, best of repeats; rank = cp // 2")
    print(header)
    print("-" * len(header))
    rows = []
    for cp in args.cp:
        for layout in args.layouts:
            for batch in args.batches:
                lengths = torch.randint(args.min_len, args.max_len + 1, (batch,), generator=gen)
                values = torch.randint(0, 100_000, (int(lengths.sum()),), generator=gen)
                offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
                device_values = values.to(args.device)
                x = torch.nested.nested_tensor_from_jagged(device_values, offsets=offsets.to(args.device))
                rank = cp // 2
                nan = float("nan")
                with fake_parallel_state(1, cp, rank):
                    t_ours, (rows_o, params_o, _) = timed(
                        lambda: ours.preprocess_thd_engine(x, cp_layout=layout), args.repeats, args.device
                    )
                    if verl_util is not None:
                        t_verl, (rows_ref, params_v, _) = timed(
                            lambda: verl_util.preprocess_thd_engine(x, cp_layout=layout),
                            args.repeats,
                            args.device,
                            args.verl_budget_s,
                        )
                        reference = "verl"
                    else:  # no verl here: check the device's rows against our own CPU result instead
                        t_verl = nan
                        x_cpu = torch.nested.nested_tensor_from_jagged(values, offsets=offsets)
                        rows_ref = ours.preprocess_thd_engine(x_cpu, cp_layout=layout)[0]
                        reference = "verl_ds4 on the CPU"
                    if not torch.equal(rows_o.cpu(), rows_ref.cpu()):
                        print(f"MISMATCH with {reference} in packed rows at B={batch} cp={cp} {layout}", file=sys.stderr)
                        return 1
                    local = rows_o.to(torch.float32)
                    index = torch.randint(0, values.numel(), (local.shape[1],), generator=gen).to(args.device)
                    t_copy, _ = timed(lambda: device_values.index_select(0, index), args.repeats, args.device)
                    t_post_o, _ = timed(
                        lambda: ours.postprocess_thd_engine(local, params_o, x, batch, cp_layout=layout),
                        args.repeats,
                        args.device,
                    )
                    t_post_v = nan
                    if verl_util is not None:
                        t_post_v, _ = timed(
                            lambda: verl_util.postprocess_thd_engine(local, params_v, x, batch, cp_layout=layout),
                            args.repeats,
                            args.device,
                            args.verl_budget_s,
                        )
                row = dict(B=batch, cp=cp, layout=layout, verl_pre=t_verl, ours_pre=t_ours, copy=t_copy,
                           verl_post=t_post_v, ours_post=t_post_o)
                rows.append(row)
                print(
                    f"{batch:>5} {cp:>3} {layout:>10} | {t_verl:>10.2f} {t_ours:>9.3f} {t_verl / t_ours:>9.1f} "
                    f"{t_copy:>8.3f} {t_ours / t_copy:>9.1f} | {t_post_v:>10.2f} {t_post_o:>9.3f} "
                    f"{t_post_v / t_post_o:>9.1f}",
                    flush=True,
                )
    # Linearity of our preprocess in B (B=4096 against B=1024).
    by_key = {(r["B"], r["cp"], r["layout"]): r for r in rows}
    ratios = [
        by_key[(4096, cp, lay)]["ours_pre"] / by_key[(1024, cp, lay)]["ours_pre"]
        for (b, cp, lay) in by_key
        if b == 4096 and (1024, cp, lay) in by_key
    ]
    copy_ratios = [
        by_key[(4096, cp, lay)]["copy"] / by_key[(1024, cp, lay)]["copy"]
        for (b, cp, lay) in by_key
        if b == 4096 and (1024, cp, lay) in by_key
    ]
    if ratios:
        print(f"ours preprocess time B=4096 / B=1024: {', '.join(f'{r:.2f}' for r in ratios)} (4.0 = linear)")
        # the copy moves 4x the rows too: above 4.0 it shows what caches do to any pass over the rows
        print(f"raw copy time       B=4096 / B=1024: {', '.join(f'{r:.2f}' for r in copy_ratios)} (same cells)")
    if rows and verl_util is not None:
        print(f"median speed-up preprocess {statistics.median(r['verl_pre'] / r['ours_pre'] for r in rows):.0f}x, "
              f"postprocess {statistics.median(r['verl_post'] / r['ours_post'] for r in rows):.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
