"""Step time of verl 0.9.1's stock Megatron engine data path vs verl-ds4's, side by side, as a ratio.

    python benchmarks/bench_engine_paths.py [--cp 2] [--sequences 256] [--steps 4] [--out FILE]

Both run the same tiny dense model (zigzag attention, the layout verl chooses for non-DS4 models)
on the same batches through verl's ``TrainingWorker`` on 2 CPU processes
(:mod:`verl_ds4.testing.engine_differential`): one micro-batch of ``--sequences`` sequences per
step, a forward (log-probs) and a training step. Reported: the median over steps after the first
(warm-up) of each phase, and ours / stock. On a CPU the model's compute dominates; the ratio
shows what the data path costs on top of it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from verl_ds4.mcore.distributed import free_port  # noqa: E402
from verl_ds4.cpu.sft_data import prepare_cpu_sft_assets  # noqa: E402
from verl_ds4.cpu.sft_run import cpu_env  # noqa: E402


def run(engine: str, assets: Path, cp: int, sequences: int, steps: int, out: Path) -> dict:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
        "-m", "verl_ds4.testing.engine_differential", "--assets", str(assets), "--engine", engine,
        "--cp", str(cp), "--out", str(out), "--steps", str(steps),
        "--batch", str(sequences), "--micro-batch", str(sequences * cp // 2),
    ]  # fmt: skip
    done = subprocess.run(cmd, env=cpu_env(), capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{engine} run failed:\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--sequences", type=int, default=256, help="sequences per step (one micro-batch per DP rank)")
    parser.add_argument("--steps", type=int, default=4, help="steps per engine (the first is warm-up)")
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step is warm-up)")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        assets = tmp / "assets"
        prepare_cpu_sft_assets(assets, model="tiny_dense", n_train=args.sequences * args.steps)
        print(f"[bench] {args.steps} steps x {args.sequences} sequences, CP={args.cp}, 2 CPU processes", flush=True)
        results = {}
        for engine in ("stock", "ours"):
            print(f"[bench] running the {engine} engine ...", flush=True)
            results[engine] = run(engine, assets, args.cp, args.sequences, args.steps, tmp / f"{engine}.json")
    tokens = sum(results["stock"]["steps"][0]["lengths"])
    lines = [
        f"# python benchmarks/bench_engine_paths.py --cp {args.cp} --sequences {args.sequences} --steps {args.steps}",
        f"# {args.sequences} sequences per step ({tokens} tokens on the logging rank's shard in step 1); median of "
        f"steps 2..{args.steps}, seconds",
        "phase        stock     ours   ours/stock",
    ]
    for phase in ("infer_s", "train_s"):
        stock = statistics.median(s[phase] for s in results["stock"]["steps"][1:])
        ours = statistics.median(s[phase] for s in results["ours"]["steps"][1:])
        lines.append(f"{phase[:-2]:<10} {stock:8.3f} {ours:8.3f}   {ours / stock:8.3f}")
    same = [s["loss"] for s in results["stock"]["steps"]] == [s["loss"] for s in results["ours"]["steps"]]
    lines.append(f"losses identical: {same}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
