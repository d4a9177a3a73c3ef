"""Forward the tiny DS4's (or the assets' model's: ``assets.json``) *value head* (the critic) through verl's own ``TrainingWorker`` on CPU processes.

    torchrun --nproc_per_node=2 -m verl_ds4.cpu.value_forward ASSETS_DIR CP OUT.json

verl's SFT trainer only builds language models, so this module builds the critic the way verl's
PPO trainer does (``TrainingWorker(model_type="value_model")`` on ``strategy=megatron``, verl's
config tree composed with Hydra), packs a few DS4-encoded conversations with ``no_padding`` and
runs ``infer_batch``. The logging rank writes the per-token values (original token order) to
``OUT.json``, so runs at different CP sizes can be compared. Requires ``VERL_PLATFORM=cpu`` and
``VERL_USE_EXTERNAL_MODULES=verl_ds4.cpu.platform,verl_ds4.cpu.engine`` (see
:func:`verl_ds4.cpu.sft_run.cpu_env`).
"""

from __future__ import annotations

import json
import sys


def _external_lib(assets: str) -> str:
    """The builder module of the assets' model (their ``assets.json``; the DS4 builder without one)."""
    from pathlib import Path

    from verl_ds4.cpu.sft_data import ASSETS_RECORD, MODEL_EXTERNAL_LIBS

    record = Path(assets) / ASSETS_RECORD
    model = json.loads(record.read_text()).get("model", "ds4") if record.is_file() else "ds4"
    return MODEL_EXTERNAL_LIBS[model]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    assets, cp, out_path = argv[0], int(argv[1]), argv[2]

    import torch
    from omegaconf import OmegaConf

    import verl  # noqa: F401  (imports VERL_USE_EXTERNAL_MODULES: the CPU platform and engines)
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import SFTTensorCollator
    from verl.utils.distributed import initialize_global_process_group

    from verl_ds4.cpu.training_worker import cpu_training_worker
    from verl_ds4.models.ds4.sft_dataset import DS4ChatSFTDataset

    initialize_global_process_group()
    worker, model_config = cpu_training_worker(
        "value_model", f"{assets}/model", cp, overrides=[f"model.external_lib={_external_lib(assets)}", "engine.forward_only=True"]
    )
    dataset = DS4ChatSFTDataset(
        f"{assets}/data/train.parquet", model_config.tokenizer, OmegaConf.create({"max_length": 256})
    )
    batch = SFTTensorCollator("no_padding")([dataset[i] for i in range(6)])
    meta = {
        "use_remove_padding": True,
        "use_dynamic_bsz": False,
        "micro_batch_size_per_gpu": 3,
        "temperature": 1.0,
        "pad_mode": "no_padding",
        "pad_token_id": model_config.tokenizer.pad_token_id,
        "compute_loss": False,
        "global_batch_size": 6,
    }
    data = tu.get_tensordict(tensor_dict=batch, non_tensor_dict=meta)
    tu.assign_non_tensor(data, global_token_num=[int(n) for n in batch["input_ids"].offsets().diff()])
    output = worker.infer_batch(data)
    if output is not None and torch.distributed.get_rank() == 0:
        values = tu.get(output, "values")
        flat = values.values() if getattr(values, "is_nested", False) else values
        lengths = batch["input_ids"].offsets().diff().tolist()
        with open(out_path, "w") as f:
            json.dump({"cp": cp, "lengths": lengths, "values": flat.float().flatten().tolist()}, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
