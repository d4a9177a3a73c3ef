"""The ``cpu_demo`` rollout's model for the production CPU engine: Megatron-LM dev's DS4 built by Megatron-Bridge.

With ``VERL_ENGINE_VENDOR=production`` (:mod:`verl_ds4.cpu.production_engine`) the actor is dev's DeepSeek-V4 built
by Megatron-Bridge's provider, and its weight sync is verl's own GPU path: ``engine.get_per_tensor_param()`` streams
``bridge.export_hf_weights(...)``, the HF tensors in DeepSeek's native names, as a vLLM or SGLang server would receive
them. :class:`ProductionCPUPolicy` is the rollout side of that: the same model built the same way on one CPU rank
(:class:`verl_ds4.verify.production.ProductionBuilder` at CP 1, from the model folder of ``model.path``), which loads
each sync through Bridge's own HF -> Megatron load (the tensors are written as one safetensors file beside the
folder's config, then ``bridge.load_hf_weights``). The forward is the parent's: verl-ds4's THD forward at CP 1.

Select it with ``VERL_DS4_CPU_ROLLOUT_POLICY=verl_ds4.rollout.production_policy.ProductionCPUPolicy``
(``scripts/run_ds4_proxy_ppo_cpu.sh`` does with ``ENGINE=production``). The process must import Megatron-LM dev
(``VERL_USE_EXTERNAL_MODULES`` lists ``verl_ds4.cpu.production_engine`` before anything imports megatron).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable

import torch

from verl_ds4.rollout.policy import MegatronCPUPolicy, ensure_single_rank_megatron

__all__ = ["ProductionCPUPolicy"]


class ProductionCPUPolicy(MegatronCPUPolicy):
    """Megatron-LM dev's DS4 (Bridge-built, CPU substitutes) on one CPU rank; takes the actor's Bridge export."""

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32, share_embeddings: bool | None = None):
        from verl_ds4.verify.production import ProductionBuilder

        folder = Path(str(getattr(hf_config, "_name_or_path", "") or ""))
        if not (folder / "config.json").is_file():
            raise ValueError(
                f"the production rollout builds its model from the folder of actor_rollout_ref.model.path; "
                f"hf_config names {str(folder)!r}, which has no config.json (give model.path as a local DeepSeek-V4 "
                "folder in DeepSeek's native names)")
        ensure_single_rank_megatron()
        built = ProductionBuilder(folder, dtype)(1)
        self.folder = folder
        self.model = built.gpt.eval()
        for param in self.model.parameters():
            param.requires_grad_(False)
        self.dtype = dtype
        self.vocab_size = int(hf_config.vocab_size)
        self.weight_version = 0
        # the tensors every sync must bring (name -> shape), read once from the folder's safetensors headers
        from safetensors import safe_open

        self._expected: dict[str, tuple[int, ...]] = {}
        for path in sorted(folder.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                self._expected.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})

    def parameter_names(self) -> list[str]:
        return [name for name, _ in self.model.named_parameters()]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load the actor's ``bridge.export_hf_weights`` stream (HF names) through Bridge's HF -> Megatron load.

        Every tensor the folder has must arrive with its shape and nothing else: a missing, unexpected or mis-shaped
        tensor is an error that names it (the actor and the rollout were built from different folders)."""
        from safetensors.torch import save_file

        from verl_ds4.substitutes.cuda_literals import cuda_literals_on_cpu
        from verl_ds4.substitutes.environment import no_torch_function_mode, quiet_progress

        tensors = {name: t.detach().to("cpu").contiguous() for name, t in weights}
        expected = self._expected
        missing = sorted(set(expected) - set(tensors))
        unexpected = sorted(set(tensors) - set(expected))
        wrong = sorted(k for k in set(expected) & set(tensors) if tuple(tensors[k].shape) != expected[k])
        if missing or unexpected or wrong:
            raise ValueError(
                "The actor's exported weights do not match the production rollout's folder "
                f"{self.folder}: missing {missing[:5]} ({len(missing)}), unexpected {unexpected[:5]} ({len(unexpected)}), "
                f"mis-shaped {wrong[:5]} ({len(wrong)}). Start actor and rollout from the same model.path.")
        with tempfile.TemporaryDirectory(prefix="verl_ds4_rollout_sync_") as tmp:
            for name in ("config.json", "generation_config.json"):
                if (self.folder / name).is_file():
                    shutil.copy(self.folder / name, Path(tmp) / name)
            save_file(tensors, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
            (Path(tmp) / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {}, "weight_map": {name: "model.safetensors" for name in tensors}}))
            from megatron.bridge import AutoBridge

            bridge = AutoBridge.from_hf_pretrained(tmp)
            with cuda_literals_on_cpu(), quiet_progress(), no_torch_function_mode(), torch.no_grad():
                bridge.load_hf_weights([self.model], tmp)
        self.weight_version += 1
        return len(tensors)
