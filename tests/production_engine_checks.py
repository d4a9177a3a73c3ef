"""verl's own Megatron engine (the production CPU engine: Megatron-LM dev's DS4 built by Megatron-Bridge inside verl's
``_build_tf_config`` / ``_build_megatron_module``) on gloo ranks, against :class:`verl_ds4.verify.production.
ProductionBuilder` on the same folder. Prints ``RESULT {json}``.

Run by tests/test_production_engine_on_cpu.py in a fresh interpreter (this one imports Megatron-LM dev in place of the
installed megatron-core): ``python tests/production_engine_checks.py COMMIT ARGS_JSON`` with
``ARGS_JSON = {"assets": {...tests/production_engine_folder.py...}, "runs": ["lm1", "lm2", "critic1", "refused"]}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from functools import partial

#: sequences of the batch (the assets' first chat conversations), micro-batch size
N_SEQ, MICRO = 4, 2


def _setup(commit: str) -> None:
    from verl_ds4.substitutes import megatron_dev

    os.environ.update(VERL_PLATFORM="cpu", VERL_ENGINE_VENDOR="production",
                      VERL_USE_EXTERNAL_MODULES="verl_ds4.cpu.platform,verl_ds4.cpu.production_engine")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    megatron_dev.use(megatron_dev.find(commit))
    import verl  # noqa: F401  (loads the CPU platform and the production engines: dev, Bridge, substitutes)


def _batch(assets: dict, tokenizer):
    from omegaconf import OmegaConf
    from verl.utils.dataset.dataset_utils import SFTTensorCollator

    from verl_ds4.models.ds4.sft_dataset import DS4ChatSFTDataset

    dataset = DS4ChatSFTDataset(assets["train"], tokenizer, OmegaConf.create({"max_length": 256}))
    return SFTTensorCollator("no_padding")([dataset[i] for i in range(N_SEQ)])


def _data(batch, tokenizer, **extra):
    from verl.utils import tensordict_utils as tu

    meta = {"use_remove_padding": True, "use_dynamic_bsz": False, "micro_batch_size_per_gpu": MICRO,
            "temperature": 1.0, "pad_mode": "no_padding", "pad_token_id": tokenizer.pad_token_id,
            "global_batch_size": N_SEQ, **extra}
    from tensordict.tensorclass import NonTensorData

    data = tu.get_tensordict(tensor_dict=dict(batch), non_tensor_dict=meta)
    tu.assign_non_tensor(data, global_token_num=NonTensorData([int(n) for n in batch["input_ids"].offsets().diff()]))
    return data


def _value_loss(config, model_output, data, dp_group=None):
    """A critic step's loss: mean squared value over the loss-masked tokens (any finite loss moves the head)."""
    import torch

    values = model_output["values"].values().float()
    mask = torch.roll(data["loss_mask"].values(), shifts=-1, dims=0).float()
    return (values.square() * mask).sum() / data["batch_num_tokens"] * data["dp_size"], {}


def _engine_rank(rank: int, world: int, assets: dict, model_type: str, overrides: list, steps: int) -> dict:
    import torch
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import sft_loss

    from verl_ds4.cpu.training_worker import cpu_training_worker
    from verl_ds4.substitutes.precision import StableTopK

    start = time.monotonic()
    worker, model_config = cpu_training_worker(
        model_type, assets["model"], world,
        overrides=["engine.use_dist_checkpointing=False", "checkpoint.save_contents=[optimizer,extra]",
                   "model.use_remove_padding=True", "optim.lr=1e-2",
                   "optim.clip_grad=1.0", "optim.total_training_steps=10", *overrides])
    engine = worker.engine
    built = time.monotonic() - start
    out = {"engine": f"{type(engine).__module__}.{type(engine).__qualname__}", "build_s": round(built, 1),
           "layout": engine.resolved_cp_layout.layout,
           "overrides": {k: repr(v) for k, v in engine.engine_config.override_transformer_config.items()},
           "gpt": type(engine.module[0].module if hasattr(engine.module[0], "module") else engine.module[0]).__module__}
    from verl.utils.megatron_utils import unwrap_model

    gpt = unwrap_model(engine.module[0])
    out["output_layer"] = f"{type(gpt.output_layer).__module__}.{type(gpt.output_layer).__qualname__}"
    out["bridge"] = f"{type(engine.bridge).__module__}.{type(engine.bridge).__qualname__}"
    out["provider"] = type(engine.provider).__name__ if engine.provider is not None else None
    out["vanilla_bridge"] = engine.vanilla_bridge
    import verl.models.mcore.bridge as verl_bridge

    out["make_value_model"] = verl_bridge.make_value_model.__module__
    out["devices"] = sorted({p.device.type for p in gpt.parameters()})
    out["dtypes"] = sorted({str(p.dtype) for p in gpt.parameters()})
    out["mtp"] = getattr(gpt, "mtp", None) is not None
    batch = _batch(assets, model_config.tokenizer)
    key = "log_probs" if model_type == "language_model" else "values"
    with StableTopK():  # the reference's tie rule for the tiny model's indexer scores (see ProductionBuilder)
        output = worker.infer_batch(_data(batch, model_config.tokenizer, compute_loss=False))
    if output is not None:
        values = tu.get(output, key)
        out[key] = [t.double().tolist() for t in values.unbind()]
        out["lengths"] = [int(n) for n in batch["input_ids"].offsets().diff()]
        out["loss_mask"] = [t.tolist() for t in batch["loss_mask"].unbind()]
    params = {n: p.detach().clone() for n, p in gpt.named_parameters()}
    worker.set_loss_fn(partial(sft_loss, config=None) if model_type == "language_model" else partial(_value_loss, None))
    losses = []
    for _ in range(steps):
        with StableTopK():
            metrics = worker.train_batch(_data(batch, model_config.tokenizer, update_lr_scheduler=True))
        if metrics is not None:
            loss = metrics["metrics"]["loss"]
            losses.append(float(loss[0] if isinstance(loss, list) else loss))
    out["losses"] = losses
    moved = {n: float((p.detach() - params[n]).abs().max()) for n, p in gpt.named_parameters()}
    out["params"] = len(moved)
    out["params_moved"] = sum(v > 0 for v in moved.values())
    out["params_still"] = sorted(n for n, v in moved.items() if v == 0)
    out["head_moved"] = moved.get("output_layer.weight", 0.0)
    out["seconds"] = round(time.monotonic() - start, 1)
    torch.distributed.barrier()
    return out if rank == 0 else {}


def _refused_rank(rank: int, world: int, assets: dict, overrides: list) -> dict:
    """Construct the engine with ``overrides`` (forward only): refused (type, message) or built (its overrides)."""
    from verl_ds4.cpu.training_worker import cpu_training_worker

    try:
        worker, _ = cpu_training_worker("language_model", assets["model"], 1,
                                        overrides=["engine.use_dist_checkpointing=False", "engine.forward_only=True",
                                                   *overrides])
    except Exception as e:  # noqa: BLE001 - the test checks the type and message
        return {"refused": True, "type": type(e).__name__, "message": str(e)[:1500]}
    engine = worker.engine
    return {"refused": False, "overrides": {k: repr(v) for k, v in engine.engine_config.override_transformer_config.items()},
            "provider": {k: repr(getattr(engine.provider, k, None)) for k in ("dsa_indexer_loss_coeff", "moe_grouped_gemm")},
            "engine": type(engine).__name__}


def _reference(folder: str, sequences, cp: int) -> list:
    """ProductionBuilder's per-token log-probs of the next token (the last token of each sequence has none)."""
    import torch

    from verl_ds4.models.ds4.hf_check import run_on_cp_ranks
    from verl_ds4.verify.production import ProductionBuilder

    logits = run_on_cp_ranks(ProductionBuilder(folder, torch.float32), sequences, cp, dtype=torch.float64)
    return [torch.log_softmax(x, -1)[:-1].gather(-1, s[1:, None].long())[:, 0].tolist()
            for x, s in zip(logits, sequences)]


def main(commit: str, args: dict) -> dict:
    _setup(commit)
    import megatron.core

    from verl_ds4.mcore.distributed import run_distributed

    assets = args["assets"]
    result: dict = {"commit": commit, "megatron_file": megatron.core.__file__, "runs": {}}
    from verl.workers.engine.base import EngineRegistry

    result["registry"] = {mt: {str(k): f"{v.__module__}.{v.__qualname__}" for k, v in by.get("megatron", {}).items()}
                          for mt, by in EngineRegistry._engines.items()}
    runs = {"lm1": ("language_model", 1, 2), "lm2": ("language_model", 2, 1),
            "critic1": ("value_model", 1, 1), "critic2": ("value_model", 2, 1)}
    result["selected"] = _selected()
    try:
        import modelopt.torch.quantization.utils  # noqa: F401  (Bridge's save_hf_weights imports it)

        result["modelopt"] = True
    except ImportError:
        result["modelopt"] = False
    for name in args["runs"]:
        start = time.monotonic()
        if name in args.get("refused", {}):
            over = [o.format(**assets) for o in args["refused"][name]]  # "{transformers_model}": a folder path
            result["runs"][name] = run_distributed(_refused_rank, world_size=1, args=(assets, over), timeout=600)[0]
        elif name.startswith("reference"):
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(assets["model"])
            batch = _batch(assets, tok)
            seqs = [t.long() for t in batch["input_ids"].unbind()]
            folder = assets["model"] if name == "reference" else assets[name.split("_", 1)[1]]
            result["runs"][name] = {"log_probs": _reference(folder, seqs, 1), "folder": folder}
        else:
            model_type, cp, steps = runs[name]
            result["runs"][name] = run_distributed(_engine_rank, world_size=cp, args=(assets, model_type, [], steps),
                                                   timeout=900)[0]
        result["runs"][name]["wall_s"] = round(time.monotonic() - start, 1)
        print(f"[production_engine_checks] {name}: {time.monotonic() - start:.1f}s", file=sys.stderr, flush=True)
    return result


def _selected() -> dict:
    """The engine class verl's registry picks for ``device="cpu"``, with and without ``VERL_ENGINE_VENDOR``."""
    from verl.workers.engine.base import EngineRegistry

    out = {}
    for vendor in ("production", None):
        saved = os.environ.pop("VERL_ENGINE_VENDOR", None)
        if vendor:
            os.environ["VERL_ENGINE_VENDOR"] = vendor
        try:
            for model_type in ("language_model", "value_model"):
                cls = EngineRegistry.get_engine_cls(model_type, "megatron")
                out[f"{model_type}/{vendor}"] = f"{cls.__module__}.{cls.__qualname__}"
        finally:
            os.environ.pop("VERL_ENGINE_VENDOR", None)
            if saved is not None:
                os.environ["VERL_ENGINE_VENDOR"] = saved
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1], json.loads(sys.argv[2]))), flush=True)
