"""Peak memory of ``verl-ds4 verify --seq-len N``'s CP 1 reference: one actor training step of the tiny DS4 (fp64).

Runs the step that ``verify`` runs at CP 1 (``verl_ds4.verify.parity``: the full tiny DS4 with its indexer loss,
the ``--seq-len`` batch ``[5, 300, N, 37, 129, 3]``) in this process, forward and backward, and prints the wall
time and the process's max RSS. ``--bound-malloc`` fixes glibc's mmap threshold as ``verify --seq-len`` does.
Run it with ``PYTHONPATH`` at a checkout to measure that checkout (the row chunks' effect: this branch vs main)::

    PYTHONPATH=. python benchmarks/bench_verify_seqlen_memory.py 8192 --bound-malloc
    PYTHONPATH=/path/to/main python benchmarks/bench_verify_seqlen_memory.py 8192

Results: ``benchmarks/results/verify_seqlen_cpu.txt``.
"""

import argparse
import resource
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("n", type=int)
    parser.add_argument("--bound-malloc", action="store_true")
    parser.add_argument("--port", type=int, default=29561)
    args = parser.parse_args()
    from megatron.core import parallel_state

    from verl_ds4.verify import parity, seqlen

    if args.bound_malloc:
        seqlen.bound_malloc()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(context_parallel_size=1)
    models = parity._Models("ds4", None, 1234)
    actor = models.build(torch.float64)
    ids, _ = parity._batch(seqlen.long_lengths(args.n), models.vocab, 1236)
    start = time.perf_counter()
    _, loss = parity._actor_step(actor, ids, "contiguous", 0, models.min_local_rows(actor), 1, None)
    loss.backward()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"N={args.n} tokens={sum(seqlen.long_lengths(args.n))} step {time.perf_counter() - start:.1f} s, max RSS {rss:.2f} GiB")


if __name__ == "__main__":
    main()
