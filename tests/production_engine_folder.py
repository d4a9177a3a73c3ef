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


def write_assets(out_dir: str | Path, n_train: int = 32) -> dict[str, str]:
    """``prepare_cpu_sft_assets(model="ds4")`` with ``model/`` rewritten in native names (same seeded weights)."""
    from verl_ds4.cpu.ds4_model_dir import DS4_TINY_SEED, write_ds4_weights
    from verl_ds4.cpu.sft_data import prepare_cpu_sft_assets

    out_dir = Path(out_dir)
    assets = prepare_cpu_sft_assets(out_dir / "assets", model="ds4", n_train=n_train)
    model = Path(assets["model"])
    native = out_dir / "native_model"
    shutil.copytree(model, native, ignore=shutil.ignore_patterns("model.safetensors", "config.json"))
    config = json.loads((model / "config.json").read_text())
    write_ds4_weights(native, config, seed=DS4_TINY_SEED, family="native")
    (native / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return {**assets, "model": str(native), "transformers_model": str(model)}


if __name__ == "__main__":
    print(json.dumps(write_assets(sys.argv[1])))
