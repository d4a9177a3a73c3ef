"""Write the production engine's tiny DS4 folder: the CPU SFT assets (tokenizer, chat data) with the model folder's
weights in DeepSeek's native names (what Megatron-Bridge's DS4 bridge reads). Runs on the released megatron-core
(verl-ds4's own model writes the weights), so in the pytest process or a plain interpreter, never beside Megatron-LM dev.

usage: python tests/production_engine_folder.py OUT_DIR   (prints the assets as JSON)
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def _write_native(rank: int, world: int, config: dict, folder: str, seed: int) -> None:
    import torch
    from megatron.core import parallel_state

    from verl_ds4.cpu.ds4_model_dir import hash_table
    from verl_ds4.models.ds4.hf_checkpoint import save_hf_checkpoint
    from verl_ds4.models.ds4.model import build_ds4_model

    parallel_state.initialize_model_parallel()
    try:
        model = build_ds4_model(config, dtype=torch.float32, seed=seed)
        tables = hash_table(config["vocab_size"], config["n_routed_experts"], config["num_experts_per_tok"], seed + 1)
        with torch.no_grad():
            for name, buf in model.named_buffers():
                if name.endswith("tid2eid"):
                    buf.copy_(tables)
        save_hf_checkpoint(model, folder, family="native", config=config)
    finally:
        parallel_state.destroy_model_parallel()


def write_assets(out_dir: str | Path, n_train: int = 32) -> dict[str, str]:
    """``prepare_cpu_sft_assets(model="ds4")`` with ``model/`` rewritten in native names (same seeded weights)."""
    from verl_ds4.cpu.ds4_model_dir import DS4_TINY_SEED
    from verl_ds4.cpu.sft_data import prepare_cpu_sft_assets
    from verl_ds4.mcore.distributed import run_distributed

    out_dir = Path(out_dir)
    assets = prepare_cpu_sft_assets(out_dir / "assets", model="ds4", n_train=n_train)
    model = Path(assets["model"])
    native = out_dir / "native_model"
    shutil.copytree(model, native, ignore=shutil.ignore_patterns("model.safetensors", "config.json"))
    config = json.loads((model / "config.json").read_text())
    run_distributed(_write_native, world_size=1, args=(config, str(native), DS4_TINY_SEED), timeout=300)
    return {**assets, "model": str(native), "transformers_model": str(model)}


if __name__ == "__main__":
    print(json.dumps(write_assets(sys.argv[1])))
