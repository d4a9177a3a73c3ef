"""``python -m verl_ds4.verify.production_weights '{"cfg": ..., "seed": N, "folder": PATH}'``: the parity harness's
tiny DS4 (verl-ds4's own model, seeded as the harness seeds it) saved as a DeepSeek-native HF folder. Run by
:func:`verl_ds4.verify.production.write_harness_folder` in an interpreter whose megatron-core is the released one."""

from __future__ import annotations

import json
import sys


def _save(rank: int, world: int, cfg, seed: int, folder: str) -> str:
    import torch
    from megatron.core import parallel_state

    from verl_ds4.models.ds4.hf_checkpoint import save_hf_checkpoint
    from verl_ds4.verify.parity import _Models

    parallel_state.initialize_model_parallel()
    try:
        models = _Models("ds4", cfg, seed)
        save_hf_checkpoint(models.build(torch.float64), folder, family="native", config=dict(models.cfg))
        return folder
    finally:
        parallel_state.destroy_model_parallel()


def main(argv=None) -> int:
    from verl_ds4.mcore.distributed import run_distributed

    args = json.loads((argv or sys.argv[1:])[0])
    run_distributed(_save, world_size=1, args=(args["cfg"], int(args["seed"]), args["folder"]), timeout=240)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
