"""The model a CPU rollout server samples from: the actor's own Megatron model, rebuilt at CP=1.

:class:`MegatronCPUPolicy` builds the model with the CPU engine's builder for the HF ``model_type``
(:data:`verl_ds4.cpu.engine.CPU_MODEL_BUILDERS`: the tiny DS4 or the DS4 proxy for ``deepseek_v4``, the tiny
dense GPT for ``llama``), so its parameter names are exactly the names of the actor's Megatron
module; :meth:`MegatronCPUPolicy.load_weights` therefore takes the actor's ``(name, tensor)``
export as is (strictly: a missing, unexpected or mis-shaped tensor is an error). It runs the
forward through verl-ds4's THD forward function (a batch of sequences packed into one THD buffer, CP=1).

Megatron needs a process group and its parallel state; a rollout server is its own process, so
the policy starts a private one-rank gloo group there when none exists (:func:`ensure_single_rank_megatron`).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch

logger = logging.getLogger(__name__)

__all__ = ["MegatronCPUPolicy", "ensure_single_rank_megatron"]


def ensure_single_rank_megatron() -> None:
    """Make sure this process has a torch.distributed group and Megatron's parallel state (all sizes 1).

    A process that already has both (a test worker) keeps them, as long as every parallel size is 1.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from verl_ds4.mcore.distributed import free_port

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel()
    sizes = {
        "tensor": mpu.get_tensor_model_parallel_world_size(),
        "pipeline": mpu.get_pipeline_model_parallel_world_size(),
        "context": mpu.get_context_parallel_world_size(),
    }
    if any(size != 1 for size in sizes.values()):
        raise RuntimeError(
            f"The CPU rollout runs its model on one rank, but this process has Megatron parallel sizes {sizes}. "
            "Run the rollout server in its own process (the CPU replica does)."
        )


class MegatronCPUPolicy:
    """The actor's Megatron model on one CPU rank: next-token logits for a batch of sequences (one packed forward)."""

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32, share_embeddings: bool | None = None):
        import importlib

        from verl_ds4.cpu.builders import CPU_MODEL_BUILDERS, cpu_transformer_overrides
        from verl_ds4.cpu.sft_data import MODEL_EXTERNAL_LIBS

        model_type = getattr(hf_config, "model_type", None)
        if model_type not in CPU_MODEL_BUILDERS:
            # The rollout server is its own process: register the demo models' builders here too
            # (the trainer's processes get them through model.external_lib).
            for module in MODEL_EXTERNAL_LIBS.values():
                importlib.import_module(module)
        builder = CPU_MODEL_BUILDERS.get(model_type)
        if builder is None:
            raise ValueError(
                f"The CPU rollout has no model builder for HF model_type={model_type!r}; registered: "
                f"{sorted(CPU_MODEL_BUILDERS)} (verl_ds4.cpu.engine.register_cpu_model_builder adds one)."
            )
        ensure_single_rank_megatron()
        if share_embeddings is None:
            share_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        tf_config = builder.transformer_config(hf_config, dtype, cpu_transformer_overrides({}))
        self.model = builder.build(
            tf_config, hf_config, pre_process=True, post_process=True, share_embeddings=share_embeddings
        )
        self.model.eval()
        for param in self.model.parameters():
            param.requires_grad_(False)
        self.dtype = dtype
        self.vocab_size = int(hf_config.vocab_size)
        self.weight_version = 0

    # -- weights --------------------------------------------------------------------------

    def parameter_names(self) -> list[str]:
        return [name for name, _ in self.model.named_parameters()]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy the actor's exported ``(name, tensor)`` pairs into the model; returns how many.

        Every parameter must arrive exactly once with its shape; names may carry the prefixes of
        Megatron's wrappers (``module.``), which are stripped.
        """
        params = dict(self.model.named_parameters())
        seen: set[str] = set()
        unexpected: list[str] = []
        with torch.no_grad():
            for name, tensor in weights:
                key = name
                while key not in params and key.startswith("module."):
                    key = key[len("module.") :]
                if key not in params:
                    unexpected.append(name)
                    continue
                target = params[key]
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(
                        f"weight {name!r}: shape {tuple(tensor.shape)} does not match the rollout model's "
                        f"{tuple(target.shape)}; the actor and the rollout were built from different configs."
                    )
                target.copy_(tensor.detach().to(device=target.device, dtype=target.dtype))
                seen.add(key)
        missing = sorted(set(params) - seen)
        if unexpected or missing:
            raise ValueError(
                "The actor's weights do not match the CPU rollout's model: "
                f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''} ({len(unexpected)}), "
                f"missing {missing[:5]}{'...' if len(missing) > 5 else ''} ({len(missing)}). "
                "The CPU rollout expects the Megatron parameter names of the actor's module."
            )
        self.weight_version += 1
        return len(seen)

    # -- forward --------------------------------------------------------------------------

    @torch.no_grad()
    def next_token_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Float32 logits ``[vocab]`` for the token after ``token_ids``."""
        return self.next_token_logits_batch([token_ids])[0]

    @torch.no_grad()
    def next_token_logits_batch(self, sequences: list[list[int]]) -> torch.Tensor:
        """Float32 logits ``[len(sequences), vocab]`` for the token after each sequence.

        One forward of the sequences packed into one THD buffer (``cu_seqlens`` keeps them apart: a
        sequence's logits do not depend on the others), the same packed forward the actor's engine runs.
        """
        return self._logits(sequences)[0]

    @torch.no_grad()
    def next_token_logits_and_choices(
        self, sequences: list[list[int]], known: list[torch.Tensor | None]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """:meth:`next_token_logits_batch` that also records the indexer's top-k choices (indexer replay).

        ``known[i]``: the choices ``[n_i, layers, index_topk]`` recorded for the first ``n_i`` rows of
        sequence ``i`` at earlier decode steps (replayed, as an engine with a KV cache keeps them), or
        ``None``; the other rows choose now. Returns the logits and each sequence's choices of all its
        rows (``[len_i, layers, index_topk]`` int32, :mod:`verl_ds4.mcore.indexer_replay`'s encoding).
        """
        from verl_ds4.mcore import batch_plans, indexer_replay, resolver

        replays = indexer_replay.enable(self.model, record=True)  # idempotent; refuses a model without an indexer
        trailing = (len(replays), max(r.width for r in replays))
        try:
            field = [indexer_replay.fill_rows(rows, len(seq), trailing) for seq, rows in zip(sequences, known)]
            with batch_plans.micro_batch_plans(), indexer_replay.micro_batch_scope():
                offsets = self._offsets(sequences)
                nested_field = torch.nested.nested_tensor_from_jagged(torch.cat(field), offsets=offsets)
                indexer_replay.set_pending(nested_field)
                logits, nested = self._logits(sequences, offsets)
                plan = batch_plans.plan_for(nested, resolver.resolved_for(self.model).plan_options(None))
                choices = plan.unpack(indexer_replay.recorded(self.model))
        finally:  # also after a refusal: no target, record or recording left for the next (native) forward
            indexer_replay.clear(self.model)
        return logits, [c.clone() for c in choices.unbind()]

    @staticmethod
    def _offsets(sequences: list[list[int]]) -> torch.Tensor:
        lengths = torch.tensor([len(seq) for seq in sequences], dtype=torch.long)
        offsets = torch.zeros(len(sequences) + 1, dtype=torch.long)
        offsets[1:] = torch.cumsum(lengths, dim=0)
        return offsets

    def _logits(self, sequences: list[list[int]], offsets: torch.Tensor | None = None):
        from verl_ds4.mcore.model_forward import gptmodel_forward_model_engine

        if not sequences or any(len(seq) == 0 for seq in sequences):
            raise ValueError("next_token_logits_batch needs at least one sequence, each of at least one token.")
        offsets = self._offsets(sequences) if offsets is None else offsets
        ids = torch.tensor([token for seq in sequences for token in seq], dtype=torch.long)
        nested = torch.nested.nested_tensor_from_jagged(ids, offsets=offsets)
        logits = gptmodel_forward_model_engine(self.model, nested, {}, value_model=False)
        if logits.is_nested:
            last = logits.values()[offsets[1:] - 1]
        else:  # one sequence returned as [1, T, vocab]
            last = logits[:, -1]
        return last[:, : self.vocab_size].float(), nested
