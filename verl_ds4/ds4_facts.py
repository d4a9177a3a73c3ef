"""DeepSeek-V4 facts and start-up rules: the one place each is written (floor 0).

Pure Python (standard library only), so every floor may import it: the layout core, the
resolver, the engines, the CPU model, the recipe validator. Nothing else in ``verl_ds4`` writes
a DS4 number or rule down; ``docs/ds4-context-parallel.md`` says where each comes from.

Facts
    :data:`HF_MODEL_TYPE`, :data:`ATTENTION_VARIANT`, :data:`CP_PARTITION_MODE`, the packing
    schedulers Megatron-LM accepts, :data:`TENSOR_PARALLEL_SIZE`, the default window, the
    compression ratios (0 sliding window, 4 CSA, 128 HCA), Flash's and Pro's decoder layer
    ratios, and :func:`layer_compress_ratios` / :func:`mtp_layers`, which read them from a
    model's own Hugging Face config.

Rows
    :func:`window_rows` (``D_window`` of one layer) and :func:`min_local_rows` (of a model): the
    fewest rows every CP rank must hold, which the engine pads each micro-batch to and the
    recipe validator checks token budgets against.

RoPE
    :func:`yarn_settings` (the compressed layers' YaRN as ``config.json`` gives it: transformers 5's
    ``rope_parameters`` or the older ``rope_scaling``) and :func:`check_rope` (both given and disagreeing,
    neither given, not YaRN: refused; V4 and V4.1 readers).

Rules
    ``check_*`` functions return ``None`` or a :class:`Violation` (the setting, its value, why it
    cannot work, the fix). The engine raises them at start-up (:meth:`Violation.engine_message`),
    the recipe validator collects them (:meth:`Violation.recipe_problem`): one rule, one text.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

#: Hugging Face ``model_type`` of DeepSeek-V4 (``DeepseekV4ForCausalLM``).
HF_MODEL_TYPE = "deepseek_v4"
#: ``TransformerConfig.experimental_attention_variant`` of DS4's hybrid attention (Megatron-LM dev).
ATTENTION_VARIANT = "dsv4_hybrid"
#: The only CP partition DS4 attention addresses correctly: each rank derives positions from one
#: offset (``cp_rank * local_rows``), so it must own one contiguous interval of the packed buffer.
CP_PARTITION_MODE = "contiguous"
#: Megatron-LM dev accepts DS4 with THD CP only under these packing schedulers (a validation gate).
SEQUENCE_PACKING_SCHEDULERS = ("dp_balanced", "default_dynamic_cp")
#: What the engine fills in when the user sets no scheduler (verl 0.9.1 forces the same).
DEFAULT_SEQUENCE_PACKING_SCHEDULER = "default_dynamic_cp"
#: DS4's hybrid attention has no tensor-parallel implementation.
TENSOR_PARALLEL_SIZE = 1
#: Sliding window of every layer (``sliding_window`` / ``csa_window_size``) when a config has none.
DEFAULT_WINDOW = 128

#: Compression ratio per attention kind.
WINDOW_ONLY, CSA_RATIO, HCA_RATIO = 0, 4, 128
COMPRESS_RATIOS = (WINDOW_ONLY, CSA_RATIO, HCA_RATIO)
#: transformers' ``layer_types`` names -> compression ratio.
LAYER_TYPE_RATIOS = {
    "sliding_attention": WINDOW_ONLY,
    "compressed_sparse_attention": CSA_RATIO,
    "heavily_compressed_attention": HCA_RATIO,
}
#: An MTP layer is a window-only DS4 layer.
MTP_COMPRESS_RATIO = WINDOW_ONLY

#: Decoder layer ratios (MTP excluded) of the published models.
FLASH_LAYER_RATIOS: tuple[int, ...] = (0, 0, 4) + (128, 4) * 20  # 43 layers
PRO_LAYER_RATIOS: tuple[int, ...] = (128, 128, 4) + (128, 4) * 29  # 61 layers


def with_mtp(decoder_ratios: Iterable[int], mtp: int) -> tuple[int, ...]:
    """Megatron's ``csa_compress_ratios``: the decoder layers' ratios, then one per MTP layer."""
    return tuple(int(r) for r in decoder_ratios) + (MTP_COMPRESS_RATIO,) * int(mtp)


def _get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def _text_config(config: Any) -> Any:
    text = _get(config, "text_config")
    return config if text is None else text


def layer_compress_ratios(config: Any) -> tuple[int, ...]:
    """Decoder-layer compression ratios of a Hugging Face DS4 config (a ``config.json`` dict or
    a ``DeepseekV4Config``), MTP excluded.

    Read from ``layer_types`` with ``compress_rates`` (transformers >= 5.10), else the legacy
    per-layer ``compress_ratios``; a config with neither gets transformers' default pattern
    (two HCA layers, then HCA / CSA alternating).
    """
    config = _text_config(config)
    n = int(_get(config, "num_hidden_layers"))
    layer_types = _get(config, "layer_types")
    if layer_types is not None:
        rates = dict(LAYER_TYPE_RATIOS)
        rates.update({k: int(v) for k, v in (_get(config, "compress_rates") or {}).items()})
        unknown = sorted({t for t in layer_types if t not in rates})
        if unknown:
            raise ValueError(f"layer_types has unknown attention kinds {unknown}; expected {sorted(LAYER_TYPE_RATIOS)}.")
        ratios = tuple(rates[t] for t in layer_types[:n])
    elif _get(config, "compress_ratios") is not None:
        ratios = tuple(int(r) for r in _get(config, "compress_ratios")[:n])
    else:
        ratios = (HCA_RATIO,) * min(n, 2) + tuple(CSA_RATIO if i % 2 else HCA_RATIO for i in range(max(n - 2, 0)))
    check_compress_ratios(ratios, n)
    return ratios


def check_compress_ratios(ratios: Iterable[int], num_layers: int | None = None) -> None:
    """Raise ``ValueError`` unless every ratio is one of :data:`COMPRESS_RATIOS` (and, given
    ``num_layers``, there is one per layer)."""
    ratios = tuple(ratios)
    bad = sorted({r for r in ratios if r not in COMPRESS_RATIOS})
    if bad:
        raise ValueError(f"DS4 compression ratios must be 0, 4 or 128 (window, CSA, HCA), got {bad}.")
    if num_layers is not None and len(ratios) != num_layers:
        raise ValueError(f"{len(ratios)} compression ratios for {num_layers} layers: give one per layer.")


def mtp_layers(config: Any) -> int:
    """Multi-token-prediction layers of a Hugging Face DS4 config (``num_nextn_predict_layers``)."""
    return int(_get(_text_config(config), "num_nextn_predict_layers", 0) or 0)


def window_size(config: Any) -> int:
    """The sliding window of a DS4 config: Megatron's ``csa_window_size`` or HF's ``sliding_window``."""
    config = _text_config(config)
    value = _get(config, "csa_window_size") or _get(config, "sliding_window")
    return int(value) if value else DEFAULT_WINDOW


# ------------------------------------------------------------------------------------- rows


def window_rows(window: int, compress_ratio: int) -> int:
    """``D_window`` of one DS4 attention layer: the rows a CP rank reads from its left neighbour,
    and so the fewest rows every rank must hold.

    ``max(window, 2 * m)`` for the overlapping CSA pool (``m = 4``: blocks of 2 * 4 rows),
    ``max(window, m)`` otherwise (``m = 0`` sliding window, ``m = 128`` HCA). Megatron's DS4
    raises below this.
    """
    pool = 2 * compress_ratio if compress_ratio == CSA_RATIO else compress_ratio
    return max(int(window), int(pool))


def min_local_rows(window: int, compress_ratios: Iterable[int]) -> int:
    """Fewest rows every CP rank must hold for a model: the largest :func:`window_rows` over its
    layers (MTP layers included; a model without layers needs the window)."""
    return max((window_rows(window, int(r)) for r in compress_ratios), default=int(window))


# ------------------------------------------------------------------------------------ rules


@dataclass(frozen=True)
class Violation:
    """A setting DS4 cannot run with.

    ``key``: the setting's name relative to its engine block (``tensor_model_parallel_size``,
    ``override_transformer_config.cp_partition_mode``, ...); ``value``: what it is; ``reason``:
    why that cannot work (a clause); ``fix``: what to do (a sentence); ``context``: a qualifier
    after the value (``" with CP=2"``).
    """

    key: str
    value: Any
    reason: str
    fix: str
    context: str = ""

    def engine_message(self) -> str:
        """The start-up error of an engine: ``key=value: reason. fix``."""
        return f"{self.key}={self.value!r}{self.context}: {self.reason}. {self.fix}"

    def recipe_problem(self) -> tuple[str, str, str]:
        """``(key, message, fix)`` for the recipe validator's ``Problem`` (it prefixes the engine block)."""
        return self.key, f"is {self.value!r}{self.context}, but {self.reason}.", self.fix

    def __str__(self) -> str:
        return self.engine_message()


#: Who computes the unfused DS4 sparse attention (the engine's ``sparse_attention``, recipe knob
#: ``ds4.sparse_attention``): Megatron-LM dev's own core, or verl-ds4's memory-linear one.
SPARSE_ATTENTION_CHOICES = ("megatron", "linear")


def sparse_attention_applies(sparse_attention: str | None, dsa_kernel_backend: str | None) -> bool:
    """Whether the ``sparse_attention`` choice runs on ``dsa_kernel_backend``: ``linear`` replaces functions of the
    unfused path only (backend ``none``); the fused kernels never call them."""
    return sparse_attention != "linear" or str(dsa_kernel_backend or "none") == "none"


def check_tensor_parallel(tp_size: int) -> Violation | None:
    if tp_size == TENSOR_PARALLEL_SIZE:
        return None
    return Violation(
        "tensor_model_parallel_size",
        tp_size,
        "DS4's hybrid attention does not support tensor parallelism",
        f"Set tensor_model_parallel_size={TENSOR_PARALLEL_SIZE} (scale with pipeline, expert, context or data "
        "parallelism instead).",
    )


def check_cp_partition_mode(
    mode: str | None, cp_size: int, dynamic_cp: bool = False, attention: str = "DeepSeek-V4 attention"
) -> Violation | None:
    """An explicit partition mode other than contiguous, with CP. ``None`` (unset) is fine: the
    engine fills in :data:`CP_PARTITION_MODE`. ``attention`` names the consumer in the message."""
    if mode is None or mode == CP_PARTITION_MODE or not (cp_size > 1 or dynamic_cp):
        return None
    return Violation(
        "override_transformer_config.cp_partition_mode",
        mode,
        f"{attention} needs the {CP_PARTITION_MODE} CP layout: each rank addresses its rows from one "
        f"offset, and a {mode} rank holds two chunks of every sequence and silently gets wrong positions",
        f"Remove the override or set cp_partition_mode={CP_PARTITION_MODE} (recipe knob ds4.cp_partition_mode).",
        context=f" with CP={'dynamic' if dynamic_cp else cp_size}",
    )


def check_packing_scheduler(scheduler: str | None, cp_size: int, dynamic_cp: bool = False) -> Violation | None:
    """An explicit packing scheduler Megatron-LM refuses for DS4 THD with CP. ``None`` is fine:
    the engine fills in :data:`DEFAULT_SEQUENCE_PACKING_SCHEDULER`."""
    if scheduler is None or scheduler in SEQUENCE_PACKING_SCHEDULERS or not (cp_size > 1 or dynamic_cp):
        return None
    return Violation(
        "override_transformer_config.sequence_packing_scheduler",
        scheduler,
        f"DS4 THD with context parallelism accepts only {list(SEQUENCE_PACKING_SCHEDULERS)}",
        "Pick one of those or remove the override (recipe knob ds4.sequence_packing_scheduler).",
    )


def check_rows_per_rank(rows: int | None, min_rows: int, key: str, context: str = "") -> Violation | None:
    """A per-rank row allowance (``max_seqlen_per_dp_cp_rank``, a micro-batch's rows per rank)
    below the model's :func:`min_local_rows`."""
    if rows is not None and int(rows) >= min_rows:
        return None
    return Violation(
        key,
        rows,
        f"every CP rank must hold >= {min_rows} rows (DS4's D_window; each micro-batch is padded to CP x {min_rows})",
        f"Set {key} to an integer >= {min_rows} (recipe knob ds4.{key} where there is one).",
        context=context,
    )


def fill_transformer_config(user: Mapping[str, Any], fields: Iterable[str], cp_size: int, dynamic_cp: bool) -> dict:
    """The ``override_transformer_config`` values DS4 needs that the user did not set (and the
    installed ``TransformerConfig`` has): the partition mode and the packing scheduler, with CP."""
    if not (cp_size > 1 or dynamic_cp):
        return {}
    fields = frozenset(fields)
    fills = {}
    if user.get("cp_partition_mode") is None and "cp_partition_mode" in fields:
        fills["cp_partition_mode"] = CP_PARTITION_MODE
    if user.get("sequence_packing_scheduler") is None and "sequence_packing_scheduler" in fields:
        fills["sequence_packing_scheduler"] = DEFAULT_SEQUENCE_PACKING_SCHEDULER
    return fills


# ------------------------------------------------------------------------------------- RoPE

#: The compressed layers' YaRN of the released Flash checkpoints (V4 and V4.1: x16 over 65536 positions).
FLASH_YARN = {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 65536}
#: The YaRN keys of the compressed layers' RoPE (both models), and the values YaRN means when one is left out.
YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
YARN_DEFAULTS = {"beta_fast": 32, "beta_slow": 1}


def _rope_entries(text: Any) -> tuple[Any, Any]:
    """``(rope_scaling, rope_parameters)`` as ``config.json`` gives them; V4's ``rope_parameters`` nested by
    rope kind (``{"main": ..., "compress": ...}``, transformers 5) is read at ``compress``, and one nested by kind
    without a ``compress`` entry gives the compressed layers none (``main`` is the other layers' RoPE)."""
    params = _get(text, "rope_parameters")
    if isinstance(params, Mapping) and ("main" in params or "compress" in params):
        params = params.get("compress")
    return _get(text, "rope_scaling"), params


def yarn_settings(text: Any) -> Any:
    """The compressed layers' RoPE settings of a text config: transformers 5's ``rope_parameters`` (what it and
    NeMo Automodel write and read), else the older ``rope_scaling``; ``None`` when neither is there."""
    scaling, params = _rope_entries(text)
    return params if params is not None else scaling


def _rope_type(entry: Mapping) -> Any:
    return entry.get("rope_type", entry.get("type", "default"))


def check_rope(text: Any, compressed: bool, yarn_only: bool, released: Mapping, required: bool = True) -> list[Violation]:
    """The RoPE settings of a ``config.json`` text config, as transformers 5 (``rope_parameters``) or earlier
    (``rope_scaling``) write them: both given and disagreeing, or (``compressed``: the model has compressed
    layers; ``required``) neither given, is refused, as is (``yarn_only``) anything but YaRN with a positive
    ``factor`` and ``original_max_position_embeddings``. ``released``: the checkpoint family's published values (for the fix)."""
    scaling, params = _rope_entries(text)
    example = f"rope_parameters: {dict(released)}"
    problems = []
    if isinstance(scaling, Mapping) and isinstance(params, Mapping):
        def norm(entry: Mapping, key: str) -> Any:
            value = entry.get(key, YARN_DEFAULTS.get(key))
            return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value

        differ = [k for k in YARN_KEYS if norm(scaling, k) != norm(params, k)]
        differ += ["rope_type"] if _rope_type(scaling) != _rope_type(params) else []
        if differ:
            problems.append(Violation(
                "rope_scaling", dict(scaling), f"config.json also has rope_parameters {dict(params)}, and the two "
                f"disagree on {', '.join(differ)} (transformers 5 and NeMo Automodel read rope_parameters, older readers "
                "rope_scaling)", "Keep one of them (rope_parameters, as transformers 5 writes it) or give both the "
                "same values."))
    entry, key = (params, "rope_parameters") if params is not None else (scaling, "rope_scaling")
    if entry is None:
        if compressed and required:
            problems.append(Violation(
                "rope_scaling", None, "config.json gives the compressed layers no RoPE settings (neither rope_scaling "
                "nor rope_parameters), and a built-in default would stand in for the checkpoint's", "Write the "
                f"checkpoint's YaRN settings into config.json, e.g. the released ones: {example}."))
        return problems
    if not isinstance(entry, Mapping):
        return problems + [Violation(key, entry, "expected an object (rope_type, factor, original_max_position_embeddings, "
                                     "beta_fast, beta_slow)", f"Write it as in the checkpoint's config.json, e.g. {example}.")]
    if yarn_only and compressed:
        if _rope_type(entry) != "yarn":
            problems.append(Violation(key, dict(entry), f"rope_type {_rope_type(entry)!r}: the compressed layers implement "
                                      "YaRN only", f"Give rope_type 'yarn' with the checkpoint's values, e.g. {example}."))
        bad = [k for k in YARN_KEYS[:2] if not isinstance(entry.get(k), (int, float)) or isinstance(entry.get(k), bool)
               or entry.get(k) <= 0]
        if bad:
            what = f"{bad[0]} as a positive number" if len(bad) == 1 else f"{' and '.join(bad)} as positive numbers"
            problems.append(Violation(key, dict(entry), f"YaRN needs {what}, and a built-in default would stand in for "
                                      "a missing one", f"Give the checkpoint's values, e.g. {example}."))
    return problems


__all__ = [
    "ATTENTION_VARIANT",
    "COMPRESS_RATIOS",
    "CP_PARTITION_MODE",
    "CSA_RATIO",
    "DEFAULT_SEQUENCE_PACKING_SCHEDULER",
    "DEFAULT_WINDOW",
    "FLASH_LAYER_RATIOS",
    "FLASH_YARN",
    "HCA_RATIO",
    "HF_MODEL_TYPE",
    "LAYER_TYPE_RATIOS",
    "MTP_COMPRESS_RATIO",
    "PRO_LAYER_RATIOS",
    "SEQUENCE_PACKING_SCHEDULERS",
    "TENSOR_PARALLEL_SIZE",
    "Violation",
    "WINDOW_ONLY",
    "YARN_DEFAULTS",
    "YARN_KEYS",
    "check_compress_ratios",
    "check_rope",
    "check_cp_partition_mode",
    "check_packing_scheduler",
    "check_rows_per_rank",
    "check_tensor_parallel",
    "fill_transformer_config",
    "layer_compress_ratios",
    "min_local_rows",
    "mtp_layers",
    "window_rows",
    "window_size",
    "with_mtp",
    "yarn_settings",
]
