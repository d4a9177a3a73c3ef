"""DeepSeek-V4.1 config facts and start-up rules (floor 1: standard library and ``ds4_facts`` only).

Reads a V4.1 ``config.json`` dict (nested ``text_config`` or a flat text config) and says what each
layer is, where its shared state comes from, which layers have Engram, whether a DSpark drafter is
there, and what is wrong with it. Facts from ``docs/ds4-context-parallel.md`` section 12 and the
reference (NeMo Automodel 0.7.0's ``deepseek_v41``), see ``docs/ds41-model.md``.

Layer roles (CSA2)
    ``compress_ratios[i]`` is 0 (window only), 1 (unpooled: one compressed entry per token) or r > 1
    (softmax-pooled blocks of r). A compressed layer is

    * **Full** when it is in ``kv_source_layer_ids``: it computes compressed KV and index keys (every
      KV source is also an index source) and a fresh top-k; later layers share them;
    * **Reindex** when it is in ``index_source_layer_ids`` only: a new top-k with its own indexer
      queries over the keys of the nearest Full layer at or before it; *hierarchical* (a two-level
      indexer) when it comes after ``candidate_source_layer_id``: it ranks only inside the candidate
      blocks that Full layer pre-selected;
    * **Reuse** otherwise: the compressed KV and the top-k of the nearest Full / Reindex layer.

Rules (each returns a :class:`~verl_ds4.ds4_facts.Violation`: the field, its value, why, the fix)
    * a compressed layer reads the nearest KV source at or before it, which must exist and compress
      by the same ratio; a window-only layer publishes nothing, so it is no KV or index source;
    * the candidate source is a Full layer, and no Full layer follows it (a Full layer resets the
      shared state, so a later hierarchical layer would find no candidates: the reference's config
      validator accepts that schedule and its forward then fails);
    * Engram: one table per layer, each with rows for all its hash buckets, and the tokenizer's
      normalisation tables (``tokenizer.json``, with ``engram_compressed_vocab_size`` entries after
      normalisation) in the folder;
    * DSpark (``mtp.*``): window-only stages after the backbone, targets inside the backbone;
      on a V4 model, ``mtp.enable=true`` with a DSpark drafter is refused (:func:`check_v4_mtp`);
    * ``model_type``: V4.1 code refuses a V4 folder and V4 code a V4.1 folder (:func:`check_model_type`);
    * RoPE as transformers 5 / NeMo Automodel (``rope_parameters``) or earlier (``rope_scaling``) write it:
      YaRN only, the two never disagreeing; a folder's ``config.json`` gives every key :data:`TEXT_DEFAULTS`
      would fill (no silent default).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from verl_ds4.ds4_facts import HF_MODEL_TYPE as V4_MODEL_TYPE
from verl_ds4.ds4_facts import Violation, check_rope, yarn_settings

#: Hugging Face ``model_type`` of DeepSeek-V4.1 (and of its text sub-config).
HF_MODEL_TYPE = "deepseek_v41"
HF_TEXT_MODEL_TYPE = "deepseek_v41_text"
#: Layer roles.
WINDOW, FULL, REINDEX, REUSE = "window", "full", "reindex", "reuse"
#: The file holding the tokenizer whose normalised vocabulary Engram hashes (its "tables").
TOKENIZER_FILE = "tokenizer.json"
#: Released Flash schedule (40 layers + 3 DSpark stages), for reference and tests.
FLASH_COMPRESS_RATIOS: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20 + (0,) * 3
FLASH_KV_SOURCES = (2, 8, 14, 20)
FLASH_INDEX_SOURCES = (2, 8, 14, 20, 24, 28, 32, 36)
FLASH_CANDIDATE_SOURCE = 20
FLASH_ENGRAM_LAYERS = (1, 14)
_DSPARK_KEYS = ("dspark_block_size", "dspark_target_layer_ids")
#: Values a V4.1 text config means when it leaves these keys out (the released Flash text config's).
TEXT_DEFAULTS: dict[str, Any] = {
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
    "sliding_window": 128,
    "rms_norm_eps": 1e-20,
    "candidate_source_layer_id": -1,
}  # fmt: skip


@dataclass(frozen=True)
class LayerRole:
    """One backbone layer: ``kv_source`` (the Full layer whose compressed KV and index keys it reads),
    ``topk_source`` (the layer whose top-k it attends with: itself for Full / Reindex), and
    ``candidate_source`` (hierarchical Reindex only). ``None`` where not applicable."""

    layer: int
    ratio: int
    role: str
    kv_source: int | None = None
    topk_source: int | None = None
    candidate_source: int | None = None
    engram: bool = False


@dataclass(frozen=True)
class V41Facts:
    num_layers: int
    roles: tuple[LayerRole, ...]
    window: int
    engram_layers: tuple[int, ...]
    dspark_stages: int
    dspark_targets: tuple[int, ...]

    @property
    def compress_ratios(self) -> tuple[int, ...]:
        return tuple(r.ratio for r in self.roles)


def _get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def text_value(config: Any, key: str) -> Any:
    """``key`` of a V4.1 config's text part, or its :data:`TEXT_DEFAULTS` value when absent (a folder's
    ``config.json`` must give them: :func:`read_config` with ``tokenizer_files``). ``rope_scaling`` is read from
    transformers 5's ``rope_parameters`` too, and ``rope_theta`` from it when the key itself is absent."""
    text = text_config(config)
    value = yarn_settings(text) if key == "rope_scaling" else _get(text, key)
    if value is None and key == "rope_theta" and isinstance(_get(text, "rope_parameters"), Mapping):
        value = _get(text, "rope_parameters").get("rope_theta")
    return TEXT_DEFAULTS.get(key) if value is None else value


def text_config(config: Any) -> Any:
    """The text sub-config of a nested V4.1 config (``text_config``), else the config itself."""
    text = _get(config, "text_config")
    return config if text is None else text


def _model_type(config: Any) -> Any:
    return _get(config, "model_type", _get(text_config(config), "model_type"))


def has_dspark(config: Any) -> bool:
    """The config describes a DSpark drafter (``mtp.*`` stages with ``dspark_*`` keys), not MTP."""
    text = text_config(config)
    return int(_get(text, "num_nextn_predict_layers", 0) or 0) > 0 and any(
        _get(text, key) is not None for key in _DSPARK_KEYS
    )


def check_model_type(config: Any, family: str) -> Violation | None:
    """``family`` ``"ds41"``: refuse anything but a V4.1 config; ``"ds4"``: refuse a V4.1 config
    (V4 code's own check refuses the rest)."""
    found = _model_type(config)
    if family == "ds4":
        if found not in (HF_MODEL_TYPE, HF_TEXT_MODEL_TYPE):
            return None
        return Violation(
            "model_type", found, f"this is a DeepSeek-V4.1 checkpoint, and the DeepSeek-V4 model ({V4_MODEL_TYPE!r}) "
            "has no CSA2 sharing, Engram or single-pass mHC", "Use the V4.1 model (verl-ds4 verify --model ds41, "
            f"model family ds41) or point at a {V4_MODEL_TYPE!r} folder.",
        )
    if family != "ds41":
        raise ValueError(f"family must be 'ds4' or 'ds41', got {family!r}")  # error-catalogue: internal: a caller passed a bad argument
    if found in (HF_MODEL_TYPE, HF_TEXT_MODEL_TYPE):
        return None
    what = "a DeepSeek-V4 checkpoint (its layers are V4's: ratios 0/4/128, MTP, hc_head)" if found == V4_MODEL_TYPE else "not a DeepSeek-V4.1 config"
    return Violation(
        "model_type", found, f"this is {what}", f"Point at a {HF_MODEL_TYPE!r} folder, or use the V4 model "
        "(--model ds4) for a V4 checkpoint.",
    )


def _int_list(text: Any, key: str) -> tuple[list[int] | None, Violation | None]:
    value = _get(text, key)
    if value is None:
        return None, Violation(key, None, "it is missing", f"Give {key} as in the checkpoint's config.json.")
    values = list(value)
    if any(type(v) is not int or v < 0 for v in values) or values != sorted(set(values)):
        return None, Violation(key, values, "layer ids must be non-negative integers, strictly increasing",
                               f"Write {key} as a sorted list of distinct layer ids.")
    return values, None


def _primes_above(start: int, count: int, taken: set[int]) -> list[int]:
    """The next ``count`` primes above ``start`` not in ``taken`` (trial division)."""
    found, n = [], start
    while len(found) < count:
        n += 1
        if n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1)) and n not in taken:
            found.append(n)
            taken.add(n)
    return found


def engram_hash_primes(text: Any) -> list[list[list[int]]]:
    """Hash-bucket sizes ``[engram layer][n-gram order 2..N][head]``: for each layer and order, the
    next ``engram_n_heads`` primes above ``engram_vocab_size - 1`` that no earlier bucket took."""
    text = text_config(text)
    taken: set[int] = set()
    heads, vocab = int(_get(text, "engram_n_heads")), int(_get(text, "engram_vocab_size"))
    orders = int(_get(text, "engram_max_ngram_size")) - 1
    return [[_primes_above(vocab - 1, heads, taken) for _ in range(orders)] for _ in _get(text, "engram_layer_ids")]


def engram_rows_needed(text: Any) -> list[int]:
    """Rows each Engram layer's table needs: the sum of its hash buckets (:func:`engram_hash_primes`)."""
    return [sum(sum(order) for order in layer) for layer in engram_hash_primes(text)]


def _layer_rules(text: Any, ratios: list[int], n: int) -> tuple[list[Violation], list[LayerRole]]:
    problems: list[Violation] = []
    kv, bad_kv = _int_list(text, "kv_source_layer_ids")
    index, bad_index = _int_list(text, "index_source_layer_ids")
    problems += [v for v in (bad_kv, bad_index) if v]
    if kv is None or index is None:
        return problems, []
    for key, ids in (("kv_source_layer_ids", kv), ("index_source_layer_ids", index)):
        beyond = [i for i in ids if i >= len(ratios)]
        if beyond:
            problems.append(Violation(key, ids, f"layers {beyond} are beyond compress_ratios ({len(ratios)} entries)",
                                      f"Remove them from {key} or give compress_ratios for them."))
        windows = [i for i in ids if i < len(ratios) and ratios[i] == 0]
        if windows:
            problems.append(Violation(key, ids, f"layers {windows} are window-only (compress_ratios 0): they have no "
                                      "compressed KV or index keys to share", f"Remove them from {key}, or give them "
                                      "the compression ratio of the layers that read them."))
    if not set(kv) <= set(index):
        problems.append(Violation("index_source_layer_ids", index, f"KV sources {sorted(set(kv) - set(index))} are not "
                                  "index sources: a Full layer computes the index keys its readers share",
                                  "Add every kv_source_layer_ids entry to index_source_layer_ids."))
    candidate = _get(text, "candidate_source_layer_id", -1)
    if type(candidate) is not int or candidate < -1:
        problems.append(Violation("candidate_source_layer_id", candidate, "it must be -1 (no two-level indexer) or "
                                  "a layer id", "Give the layer id of a Full layer, or -1."))
        candidate = -1
    elif candidate >= 0:
        if candidate not in kv:
            problems.append(Violation("candidate_source_layer_id", candidate, f"layer {candidate} is not a Full layer "
                                      f"(kv_source_layer_ids {kv}): only a Full layer pre-selects candidate blocks",
                                      "Point it at a layer in kv_source_layer_ids, or set -1."))
        later = [i for i in kv if candidate < i < n]
        if later:
            problems.append(Violation("candidate_source_layer_id", candidate, f"Full layers {later} come after it; a "
                                      "Full layer starts a fresh shared state, so the hierarchical layers after it "
                                      "would find no candidate blocks", "Make the last KV source the candidate "
                                      f"source (candidate_source_layer_id={kv[-1]}) or remove the later KV sources."))
        for key in ("candidate_block_size", "candidate_topk_blocks"):
            value = _get(text, key)
            if type(value) is not int or value <= 0:
                problems.append(Violation(key, value, "the two-level indexer needs a positive block size and "
                                          "block count", f"Give {key} as a positive integer, or set "
                                          "candidate_source_layer_id=-1."))
    roles, full, topk = [], None, None
    for i in range(n):
        ratio = ratios[i]
        if ratio == 0:
            roles.append(LayerRole(i, 0, WINDOW))
            continue
        if i in kv:
            full, topk = i, i
        if full is None or ratios[full] != ratio:
            first = next((s for s in kv if s > i), None)
            if full is None:
                why = f"there is none{f' (the first, layer {first}, comes later)' if first is not None else ''}"
            else:
                why = f"its nearest, layer {full}, compresses by {ratios[full]}"
            problems.append(Violation(
                "kv_source_layer_ids", kv, f"layer {i} (compress_ratios {ratio}) reads compressed KV from the nearest "
                f"KV source at or before it with the same ratio, and {why}",
                f"Add layer {i} (or an earlier layer with ratio {ratio}) to kv_source_layer_ids and "
                "index_source_layer_ids."))
            roles.append(LayerRole(i, ratio, REUSE))
            continue
        if i in kv:
            role = LayerRole(i, ratio, FULL, kv_source=i, topk_source=i)
        elif i in index:
            topk = i
            role = LayerRole(i, ratio, REINDEX, kv_source=full, topk_source=i,
                             candidate_source=candidate if 0 <= candidate < i else None)
        else:
            role = LayerRole(i, ratio, REUSE, kv_source=full, topk_source=topk)
        roles.append(role)
    return problems, roles


def _engram_rules(text: Any, n: int, vocab: int, files: Iterable[str] | None) -> list[Violation]:
    layers = list(_get(text, "engram_layer_ids") or [])
    if not any(i < n for i in layers):
        return []
    problems = []
    tables = list(_get(text, "engram_num_embeddings") or [])
    if len(tables) != len(layers) or any(type(t) is not int or t <= 0 for t in tables):
        problems.append(Violation("engram_num_embeddings", tables, f"Engram layers {layers} need one positive table "
                                  "row count each", "Give one engram_num_embeddings entry per engram_layer_ids entry."))
    sizes = {k: _get(text, k) for k in ("engram_n_heads", "engram_head_dim", "engram_vocab_size",
                                        "engram_compressed_vocab_size", "engram_max_ngram_size")}
    for key, value in sizes.items():
        low = 2 if key in ("engram_max_ngram_size", "engram_vocab_size") else 1
        if type(value) is not int or value < low:
            problems.append(Violation(key, value, f"Engram needs an integer >= {low}", f"Give {key} from the checkpoint's "
                                      "config.json, or set engram_layer_ids=[] for a model without Engram."))
    pad = _get(text, "engram_pad_token_id")
    if type(pad) is not int or not 0 <= pad < vocab:
        problems.append(Violation("engram_pad_token_id", pad, f"it must be a token id below vocab_size={vocab}",
                                  "Give the tokenizer's pad id."))
    if not problems:
        for layer, have, need in zip(layers, tables, engram_rows_needed(text)):
            if have < need:
                problems.append(Violation("engram_num_embeddings", tables, f"layer {layer}'s hash buckets need {need} "
                                          f"rows, its table has {have}", "Give the checkpoint's table sizes "
                                          "(engram_num_embeddings) or smaller engram_vocab_size / engram_n_heads."))
    if files is not None and TOKENIZER_FILE not in set(files):
        problems.append(Violation(TOKENIZER_FILE, None, f"Engram layers {layers} hash n-grams of tokenizer-normalised "
                                  "token ids, and the folder has no tokenizer to build the normalisation tables from",
                                  f"Copy the checkpoint's {TOKENIZER_FILE} (and tokenizer_config.json) into the model "
                                  "folder, or set engram_layer_ids=[] for a model without Engram."))
    return problems


def _dspark_rules(text: Any, ratios: list[int], n: int) -> list[Violation]:
    stages = int(_get(text, "num_nextn_predict_layers", 0) or 0)
    problems = []
    draft = ratios[n : n + stages]
    if len(draft) < stages or any(draft):
        problems.append(Violation("compress_ratios", ratios, f"the {stages} DSpark stages (layers {n}..{n + stages - 1}) "
                                  "are window-only: their entries must be 0", f"End compress_ratios with {stages} "
                                  "zeros after the backbone's entries."))
    targets = list(_get(text, "dspark_target_layer_ids") or [])
    if not targets or targets != sorted(set(targets)) or any(type(t) is not int or not 0 <= t < n for t in targets):
        problems.append(Violation("dspark_target_layer_ids", targets, f"DSpark reads features of distinct backbone "
                                  f"layers in [0, {n}), in increasing order", "Give the checkpoint's target layers."))
    for key in ("dspark_block_size", "dspark_markov_rank"):
        value = _get(text, key)
        if type(value) is not int or value <= 0:
            problems.append(Violation(key, value, "DSpark needs a positive integer", f"Give {key} from config.json."))
    return problems


def _rope_rules(text: Any, compressed: bool, folder: bool) -> list[Violation]:
    """RoPE as transformers 5 / NeMo Automodel (``rope_parameters``) or earlier (``rope_scaling``) write it; a
    folder's config.json must also give every :data:`TEXT_DEFAULTS` key the model reads (no silent default)."""
    problems = check_rope(text, compressed, yarn_only=True, released=TEXT_DEFAULTS["rope_scaling"], required=folder)
    params, theta = _get(text, "rope_parameters"), _get(text, "rope_theta")
    inner = params.get("rope_theta") if isinstance(params, Mapping) else None
    not_numbers = [(key, value) for key, value in (("rope_theta", theta), ("rope_parameters.rope_theta", inner))
                   if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool))]
    for key, value in not_numbers:
        problems.append(Violation(key, value, "expected a number (RoPE's base frequency; the released Flash has "
                                  f"{TEXT_DEFAULTS['rope_theta']!r})", f"Write the checkpoint's {key} into config.json "
                                  "as a number."))
    if not not_numbers and theta is not None and inner is not None and float(theta) != float(inner):
        problems.append(Violation("rope_theta", theta, f"rope_parameters gives rope_theta {inner} (transformers 5 reads "
                                  "that one, NeMo Automodel rope_theta)", "Give both the same value, the checkpoint's."))
    if folder:
        needed = [k for k in TEXT_DEFAULTS if k != "rope_scaling" and (k != "compress_rope_theta" or compressed)
                  and _get(text, k) is None and not (k == "rope_theta" and inner is not None)]
        for key in needed:
            flash = FLASH_CANDIDATE_SOURCE if key == "candidate_source_layer_id" else TEXT_DEFAULTS[key]
            problems.append(Violation(key, None, "config.json leaves it out, and a built-in default would stand in for "
                                      "the checkpoint's value", f"Write the checkpoint's {key} into config.json (the "
                                      f"released Flash: {flash!r})."))
    return problems


def config_violations(config: Any, tokenizer_files: Iterable[str] | None = None) -> list[Violation]:
    """Every rule a V4.1 config breaks. ``tokenizer_files``: the folder's file names (checks that
    Engram's tokenizer is there); ``None`` skips that check (a config without a folder)."""
    problems, _ = _read(config, tokenizer_files)
    return problems


def _read(config: Any, files: Iterable[str] | None) -> tuple[list[Violation], V41Facts | None]:
    problem = check_model_type(config, "ds41")
    if problem:
        return [problem], None
    text = text_config(config)
    n = _get(text, "num_hidden_layers")
    ratios = _get(text, "compress_ratios")
    if type(n) is not int or n <= 0:
        return [Violation("num_hidden_layers", n, "it must be a positive integer", "Give it from config.json.")], None
    if ratios is None or any(type(r) is not int or r < 0 for r in ratios) or len(ratios) < n:
        return [Violation("compress_ratios", ratios, f"V4.1 needs one non-negative ratio per layer ({n} backbone "
                          "layers, then the DSpark stages): 0 window only, 1 unpooled, r > 1 pooled by r",
                          "Give compress_ratios from the checkpoint's config.json.")], None
    ratios = list(ratios)
    problems, roles = _layer_rules(text, ratios, n)
    problems += _rope_rules(text, any(ratios[:n]), folder=files is not None)
    vocab = int(_get(text, "vocab_size", 0) or 0)
    problems += _engram_rules(text, n, vocab, files)
    if has_dspark(text):
        problems += _dspark_rules(text, ratios, n)
    if problems:
        return problems, None
    engram = tuple(i for i in (_get(text, "engram_layer_ids") or []) if i < n)
    roles = tuple(LayerRole(**{**r.__dict__, "engram": r.layer in engram}) for r in roles)
    dspark = has_dspark(text)
    facts = V41Facts(
        num_layers=n, roles=roles, window=int(_get(text, "sliding_window", 128)), engram_layers=engram,
        dspark_stages=int(_get(text, "num_nextn_predict_layers")) if dspark else 0,
        dspark_targets=tuple(_get(text, "dspark_target_layer_ids")) if dspark else (),
    )
    return [], facts


def read_config(config: Any, tokenizer_files: Iterable[str] | None = None) -> V41Facts:
    """The :class:`V41Facts` of a V4.1 config; ``ValueError`` naming every broken rule (field, fix)."""
    problems, facts = _read(config, tokenizer_files)
    if problems:
        lines = "\n".join(f"  - {p.engine_message()}" for p in problems)
        raise ValueError(f"DeepSeek-V4.1 config refused ({len(problems)} problem(s)):\n{lines}")
    assert facts is not None
    return facts


def min_local_rows(config: Any) -> int:
    """Fewest packed rows every CP rank must hold: the window, the largest compression ratio of the
    backbone (a block's rows reach back into the previous rank) and Engram's n-gram lookback
    (``engram_max_ngram_size - 1`` token ids of the previous rank)."""
    text = text_config(config)
    n = int(_get(text, "num_hidden_layers"))
    ratios = [int(r) for r in _get(text, "compress_ratios")[:n]]
    engram = any(i < n for i in (_get(text, "engram_layer_ids") or []))
    lookback = int(_get(text, "engram_max_ngram_size", 2)) - 1 if engram else 0
    return max([int(text_value(text, "sliding_window")), lookback, *ratios])


def check_v4_mtp(config: Any, mtp_enabled: bool, key: str = "ds4.mtp", off: str | None = None) -> Violation | None:
    """A V4 model with MTP switched on whose ``mtp.*`` tensors are a DSpark drafter (revisions such as
    Flash-0731 keep ``num_nextn_predict_layers: 1`` beside ``dspark_*`` keys): loading them as an MTP
    layer half-loads them. ``off``: the setting that switches MTP off (default ``{key}=false``)."""
    if not mtp_enabled or not has_dspark(config):
        return None
    return dspark_mtp_violation(key, _get(text_config(config), key, True), off)


def dspark_mtp_violation(key: str = "ds4.mtp", value: Any = True, off: str | None = None) -> Violation:
    """The refusal of MTP on a checkpoint whose ``mtp.*`` is a DSpark drafter (:func:`check_v4_mtp`)."""
    return Violation(
        key, value, "the checkpoint's mtp.* tensors are a DSpark drafter (config.json has dspark_block_size / "
        "dspark_target_layer_ids), not an MTP layer, and loading them as MTP would half-load them",
        f"Set {off or key + '=false'} (the DSpark drafter is not trained by the V4 model) or use a checkpoint "
        "revision with an MTP layer.",
    )


__all__ = [
    "FULL", "HF_MODEL_TYPE", "HF_TEXT_MODEL_TYPE", "REINDEX", "REUSE", "TOKENIZER_FILE", "WINDOW",
    "LayerRole", "V41Facts", "check_model_type", "check_v4_mtp", "config_violations", "dspark_mtp_violation", "engram_hash_primes", "engram_rows_needed",
    "has_dspark", "min_local_rows", "read_config", "text_config", "text_value", "TEXT_DEFAULTS",
]  # fmt: skip
