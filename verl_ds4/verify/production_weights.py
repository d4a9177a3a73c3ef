"""Children on the released megatron-core for the production proofs (verl-ds4's own model is built on it):

* ``python -m verl_ds4.verify.production_weights '{"cfg": ..., "seed": N, "folder": PATH}'``: the parity harness's tiny
  DS4 (seeded as the harness seeds it) saved as a DeepSeek-native HF folder
  (:func:`verl_ds4.verify.production.write_harness_folder`);
* ``... --own-parity '{"cfg": ..., "seed": N, "batch": [...], "out": PATH}'``: the own model's CP = 1 results, pickled
  (:mod:`verl_ds4.verify.production_cli`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _save(rank: int, world: int, cfg, seed: int, folder: str) -> str:
    import torch
    from megatron.core import parallel_state

    from safetensors.torch import save_file

    from verl_ds4.models.ds4.hf_checkpoint import hf_tensors_of
    from verl_ds4.verify.parity import _Models

    parallel_state.initialize_model_parallel()
    try:
        models = _Models("ds4", cfg, seed)
        model = models.build(torch.float64)
        # float64 on disk (save_hf_checkpoint's default is float32): the production model then holds exactly the
        # own model's weights, so the two can be compared at float64
        names = hf_tensors_of(model, "native")
        tensors = hf_tensors_of(model, "native", {n: torch.float64 for n, t in names.items() if t.is_floating_point()})
        Path(folder).mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(Path(folder) / "model.safetensors"), metadata={"format": "pt"})
        (Path(folder) / "config.json").write_text(json.dumps(dict(models.cfg), indent=2, sort_keys=True))
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
