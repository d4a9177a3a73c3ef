"""verl 0.9.1's stock Megatron engine data path vs verl-ds4's, on the same model and batches.

    torchrun --nproc_per_node=2 -m verl_ds4.testing.engine_differential \\
        --assets DIR --engine stock|ours --cp N --out OUT.json [--steps K] [--batch B] [--micro-batch M]

Both engines are verl's ``TrainingWorker(model_type="language_model")`` on the CPU engine mixin
(:mod:`verl_ds4.cpu.engine`): ``ours`` is verl-ds4's CPU engine (our resolver, our THD packing,
our forward functions); ``stock`` is the same mixin over verl's own ``MegatronEngineWithLMHead``
(verl's ``preprocess_thd_engine`` / forward functions; verl-ds4's hooks are never installed in
that process). The model is the tiny dense ``GPTModel`` with a zigzag attention
(:mod:`verl_ds4.testing.zigzag_dense`), the layout verl's stock engine chooses for non-DS4 models.
Per step the logging rank records the per-token log-probs (forward only) and then the SFT loss of
one training step on the same batch, the step times and the straggler metrics the steps report. Used by
``tests/test_engine_differential_on_cpu.py`` and ``benchmarks/bench_engine_paths.py``.

To select the stock engine for ``device="cpu"`` this process replaces verl-ds4's registration in
verl's ``EngineRegistry`` (a test-harness-only change, never done by the product).
"""

from __future__ import annotations

import argparse
import json
import time


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m verl_ds4.testing.engine_differential", description=__doc__)
    parser.add_argument("--assets", required=True, help="folder written by verl_ds4.cpu.sft_data --model tiny_dense")
    parser.add_argument("--engine", choices=("stock", "ours"), required=True)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (global)")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch per DP rank")
    return parser.parse_args(argv)


def _stock_cpu_engine():
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from verl_ds4.cpu.engine import _CPUMegatronEngineMixin

    class StockCPUMegatronEngineWithLMHead(_CPUMegatronEngineMixin, MegatronEngineWithLMHead):
        """verl 0.9.1's LM-head engine (its own data path) with only the CPU build/run steps replaced."""

    EngineRegistry._engines["language_model"]["megatron"]["cpu"] = StockCPUMegatronEngineWithLMHead
    return StockCPUMegatronEngineWithLMHead


def _straggler_metrics(metrics) -> dict:
    """``{key: [value per DP rank]}``: verl's TrainingWorker gathers each rank's one-element list over DP."""

    def flat(value):
        return [x for item in value for x in flat(item)] if isinstance(value, (list, tuple)) else [float(value)]

    return {k: flat(v) for k, v in (metrics or {}).items() if "straggler" in k}


def main(argv=None) -> int:
    args = _parse(argv)
    import torch
    from functools import partial

    from omegaconf import OmegaConf
    from tensordict.tensorclass import NonTensorData

    import verl  # noqa: F401  (VERL_USE_EXTERNAL_MODULES: the CPU platform and engines)
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import SFTTensorCollator
    from verl.utils.distributed import initialize_global_process_group
    from verl.workers.utils.losses import sft_loss

    from verl_ds4.cpu.training_worker import cpu_training_worker
    from verl_ds4.models.ds4.sft_dataset import DS4ChatSFTDataset
    from verl_ds4.testing.zigzag_dense import register_zigzag_dense_cpu_builder

    initialize_global_process_group()
    register_zigzag_dense_cpu_builder()
    if args.engine == "stock":
        _stock_cpu_engine()
    world = torch.distributed.get_world_size()
    worker, model_config = cpu_training_worker(
        "language_model",
        f"{args.assets}/model",
        args.cp,
        overrides=[
            "model.use_remove_padding=True",
            "engine.use_distributed_optimizer=True",
            "optim.lr=1e-3",
            "optim.clip_grad=1.0",
            "optim.total_training_steps=100",
        ],
    )
    worker.set_loss_fn(partial(sft_loss, config=None))
    engine = worker.engine
    dataset = DS4ChatSFTDataset(
        f"{args.assets}/data/train.parquet", model_config.tokenizer, OmegaConf.create({"max_length": 256})
    )
    dp = world // args.cp
    per_dp = args.batch // dp
    rank_in_dp = engine.get_data_parallel_rank()
    record = {"engine": type(engine).__name__, "cp": args.cp, "steps": []}
    for step in range(args.steps):
        first = step * args.batch + rank_in_dp * per_dp
        batch = SFTTensorCollator("no_padding")([dataset[i] for i in range(first, first + per_dp)])
        meta = {
            "use_remove_padding": True,
            "use_dynamic_bsz": False,
            "micro_batch_size_per_gpu": args.micro_batch,
            "temperature": 1.0,
            "pad_mode": "no_padding",
            "pad_token_id": model_config.tokenizer.pad_token_id,
            "global_batch_size": args.batch,
        }
        lengths = [int(n) for n in batch["input_ids"].offsets().diff()]
        # every DP rank's lengths, as verl's SFT trainer gathers them (the dataset is deterministic)
        global_lengths = NonTensorData(
            [len(dataset[i]["input_ids"]) for i in range(step * args.batch, (step + 1) * args.batch)]
        )
        infer = tu.get_tensordict(tensor_dict=dict(batch), non_tensor_dict={**meta, "compute_loss": False})
        tu.assign_non_tensor(infer, global_token_num=global_lengths)
        start = time.perf_counter()
        output = worker.infer_batch(infer)
        infer_s = time.perf_counter() - start
        train = tu.get_tensordict(tensor_dict=dict(batch), non_tensor_dict=meta)
        tu.assign_non_tensor(train, global_token_num=global_lengths, update_lr_scheduler=True)
        if step % 2:  # as verl's train_mini_batch (the RL updates) marks a mini-batch; even steps: as SFT does
            tu.assign_non_tensor(train, disable_auto_offload=True)
        start = time.perf_counter()
        metrics = worker.train_batch(train)
        train_s = time.perf_counter() - start
        if output is not None:
            log_probs = tu.get(output, "log_probs")
            flat = log_probs.values() if getattr(log_probs, "is_nested", False) else log_probs
            loss = metrics["metrics"]["loss"] if metrics is not None else None
            record["steps"].append(
                {
                    "lengths": lengths,
                    "global_lengths": list(global_lengths.data),
                    "straggler": {  # verl-ds4's per-step ratios (engine/straggler.py), update and forward pass
                        "train": _straggler_metrics(metrics["metrics"] if metrics is not None else {}),
                        "infer": _straggler_metrics(tu.get(output, "metrics")),
                    },
                    "log_probs": flat.double().flatten().tolist(),
                    "loss": float(loss[0] if isinstance(loss, list) else loss) if loss is not None else None,
                    "infer_s": infer_s,
                    "train_s": train_s,
                }
            )
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(record, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
