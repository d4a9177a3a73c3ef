"""Children on the released megatron-core for the production proofs (verl-ds4's own model is built on it):

* ``python -m verl_ds4.verify.production_weights '{"cfg": ..., "seed": N, "folder": PATH}'``: the parity harness's tiny
  DS4 (seeded as the harness seeds it) saved as a DeepSeek-native HF folder
  (:func:`verl_ds4.verify.production.write_harness_folder`);
* ``... --own-parity '{"cfg": ..., "seed": N, "batch": [...], "out": PATH}'``: the own model's CP = 1 results, pickled
  (:mod:`verl_ds4.verify.production_cli`)."""

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

    argv = list(argv or sys.argv[1:])
    if argv[0] == "--own-parity":
        from verl_ds4.verify.production_cli import own_parity

        own_parity(json.loads(argv[1]))
        return 0
    args = json.loads(argv[0])
    run_distributed(_save, world_size=1, args=(args["cfg"], int(args["seed"]), args["folder"]), timeout=240)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
