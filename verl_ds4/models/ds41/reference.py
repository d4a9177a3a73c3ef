"""NeMo Automodel 0.7.0's DeepSeek-V4.1 as an fp64 CPU reference (the tests and ``verl-ds4 verify --model ds41``).

The reference is ``nemo_automodel.components.models.deepseek_v41`` (installed without its declared
dependencies, see ``docs/ds41-model.md``): called, never copied. This module

* :func:`reference_missing`: ``None`` when the reference imports, else the reason tests skip with;
* :func:`tiny_text_config`: a ``config.json``-style dict of a tiny V4.1 with every component on:
  window-only, ratio-2 and ratio-1 layers, Full / Reindex / Reuse roles (KV and index sources), a
  hierarchical candidate source, Engram on two layers, and 3 window-only DSpark stages;
* :func:`local_tokenizer`: a local ``PreTrainedTokenizerFast`` whose vocabulary normalises onto
  fewer entries (cased and accented spellings), as Engram's compressed vocabulary needs;
* :func:`fp64_reference`: the context in which the reference computes in float64 throughout;
* :func:`build_reference_model` / :func:`build_reference_dspark`: the models, random, in fp64.

How the reference is driven in fp64 (its code is not changed):

1. ``verl_ds4.models.ds4.hf_reference.fp64_reference``: default dtype float64 and a
   ``TorchFunctionMode`` that turns every float32 request (``.float()``, ``.to(float32)``,
   ``dtype=float32``) into float64 (mHC coefficients, RMSNorm, RoPE angles, router scores, Engram
   gate, attention logits are float32 steps in the reference), with stable top-k ties.
2. ``pre_mix`` must be float32 by a type check in ``DeepseekV41Block.forward``; the check reads
   ``torch.float32`` from its module, so that module's ``torch`` is a view of ``torch`` whose
   ``float32`` is float64 while the context is open.
3. ``torch.compile`` runs eagerly (``torch.compiler.set_stance("force_eager")``): the reference
   compiles its clamped SwiGLU with ``fullgraph=True``, which dynamo cannot trace under a mode.
4. The released cache quantize/dequantize steps (``quantize_cache``: FP8 window KV, MXFP4 index
   Q/K, NVFP4 compressed KV) are replaced by the identity: they round, so two correct fp64
   computations differ by whole quantisation steps wherever a value sits near a bin edge. Our
   model has them as a separate, switchable step (tested on its own, not at 1e-10).
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import torch

__all__ = [
    "REFERENCE_VERSION",
    "reference_missing",
    "tiny_text_config",
    "local_tokenizer",
    "fp64_reference",
    "reference_context",
    "build_reference_model",
    "build_reference_dspark",
    "reference_backend",
    "reference_forward",
    "copy_reference_weights",
    "dspark_reference_tensors",
    "load_tensors",
    "reference_tensors",
]

#: The NeMo Automodel release the V4.1 reference is read from (``pip install --no-deps``).
REFERENCE_VERSION = "0.7.0"
_PKG = "nemo_automodel.components.models.deepseek_v41"


def reference_missing() -> str | None:
    """``None`` when NeMo Automodel's V4.1 model imports here, else why not (a pytest skip reason)."""
    try:
        from importlib.metadata import version

        found = version("nemo-automodel")
    except Exception:
        return (
            f"NeMo Automodel {REFERENCE_VERSION} (the V4.1 reference) is not installed: "
            f"pip install --no-deps nemo-automodel=={REFERENCE_VERSION} (scripts/dev.sh does it)"
        )
    if found != REFERENCE_VERSION:
        return f"NeMo Automodel {found} is installed; the V4.1 reference tests are written against {REFERENCE_VERSION}"
    try:
        __import__(f"{_PKG}.model")
    except Exception as exc:  # noqa: BLE001 - any import failure is a skip reason
        return f"NeMo Automodel's deepseek_v41 does not import here: {type(exc).__name__}: {exc}"
    return None


# Words whose cased / accented spellings normalise to one Engram key (NFKC, NFD, strip accents,
# lowercase, whitespace runs -> one space): 4 specials + 36 words -> 4 + 17 distinct keys.
_WORDS = (
    "the", "The", "THE", "cat", "Cat", "café", "cafe", "CAFÉ", "sat", "Sat", "on", "On", "a", "A",
    "mat", "Mat", "dog", "Dog", "ran", "RAN", "to", "To", "it", "It", "and", "And", "so", "So",
    "we", "We", "go", "Go", "up", "Up", "x", "X",
)  # fmt: skip


def local_tokenizer():
    """A local fast tokenizer (word level, 40 ids: ``<s>``, ``</s>``, ``<pad>``, ``<unk>``, then
    words in several spellings) whose Engram-normalised vocabulary has 21 entries."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(("<s>", "</s>", "<pad>", "<unk>") + _WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


#: Distinct Engram keys of :func:`local_tokenizer` (checked against the reference's own count).
LOCAL_COMPRESSED_VOCAB = 21


def tiny_text_config(**overrides: Any) -> dict[str, Any]:
    """A ``text_config`` dict of a tiny V4.1 with every component on.

    Layers (8 backbone + 3 DSpark stages), ``compress_ratios`` ``[0, 0, 2, 2, 2, 1, 1, 1] + [0]*3``:
    0, 1 window only (1 has Engram); 2 Full (ratio 2: owns compressed KV and index keys); 3
    Reindex (new top-k on layer 2's keys; Engram); 4 Reuse (layer 3's top-k); 5 Full (ratio 1,
    the candidate source); 6 hierarchical Reindex (top-k among layer 5's candidate blocks); 7 Reuse.
    """
    values: dict[str, Any] = dict(
        vocab_size=40,
        hidden_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        qk_rope_head_dim=8,
        q_lora_rank=16,
        o_lora_rank=8,
        o_groups=2,
        swiglu_limit=0.6,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 1024},
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        routed_scaling_factor=1.5,
        sliding_window=4,
        compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1, 0, 0, 0],
        kv_source_layer_ids=[2, 5],
        index_source_layer_ids=[2, 3, 5, 6],
        index_n_heads=2,
        index_head_dim=8,
        index_topk=3,
        candidate_source_layer_id=5,
        candidate_topk_blocks=2,
        candidate_block_size=2,
        hc_mult=2,
        hc_sinkhorn_iters=5,
        hc_eps=1e-6,
        engram_layer_ids=[1, 3],
        engram_num_embeddings=[200, 210],
        engram_max_ngram_size=3,
        engram_vocab_size=11,
        engram_n_heads=2,
        engram_head_dim=8,
        engram_pad_token_id=2,
        engram_compressed_vocab_size=LOCAL_COMPRESSED_VOCAB,
        num_nextn_predict_layers=3,
        dspark_block_size=3,
        dspark_noise_token_id=3,
        dspark_target_layer_ids=[5, 6, 7],
        dspark_markov_rank=4,
        dspark_n_routed_experts=4,
        dspark_num_experts_per_tok=2,
        pad_token_id=2,
        bos_token_id=0,
        eos_token_id=1,
        dtype="float64",
    )
    values.update(overrides)
    return values


def reference_backend():
    """The reference's CPU backends: eager attention, torch linear / RoPE / experts / dispatcher,
    fp32 (here fp64) RMSNorm (V4.1 attention refuses plain ``torch`` RMSNorm)."""
    from nemo_automodel.components.models.common import BackendConfig

    return BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", rope="torch", experts="torch", dispatcher="torch")


def _identity_cache(values, *, format, block_size):  # noqa: A002 - the reference's keyword
    del format, block_size
    return values


def _float64_torch() -> types.ModuleType:
    view = types.ModuleType("torch_fp64_view")
    view.__getattr__ = lambda name: getattr(torch, name)  # type: ignore[attr-defined]
    view.float32 = torch.float64
    view.float = torch.float64
    return view


@contextlib.contextmanager
def fp64_reference(quantize: bool = False):
    """The reference computes in float64 inside this context (see the module docstring); with
    ``quantize=False`` (default) its cache quantize/dequantize steps are the identity."""
    with reference_context(fp64=True, quantize=quantize):
        yield


@contextlib.contextmanager
def reference_context(fp64: bool = True, quantize: bool = False):
    """:func:`fp64_reference`, or with ``fp64=False`` the reference at its own precision (its float32
    steps stay float32; for a float32 model with ``quantize=True``: the released cache rounding),
    always with stable top-k ties and eager ``torch.compile``."""
    import importlib

    from verl_ds4.models.ds4.hf_reference import StableTopK
    from verl_ds4.models.ds4.hf_reference import fp64_reference as promote

    patched: list[tuple[Any, str, Any]] = []
    if fp64:
        patched.append((importlib.import_module(f"{_PKG}.model"), "torch", _float64_torch()))
    if not quantize:
        for name in ("attention", "dspark"):
            module = importlib.import_module(f"{_PKG}.{name}")
            if hasattr(module, "quantize_cache"):
                patched.append((module, "quantize_cache", _identity_cache))
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patched]
    try:
        for obj, name, value in patched:
            setattr(obj, name, value)
        precision = promote(stable_topk=True) if fp64 else StableTopK()
        with torch.compiler.set_stance("force_eager"), precision:
            yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def _randomise(module: torch.nn.Module, generator: torch.Generator, std: float = 0.2) -> None:
    """Every floating parameter and buffer random (norm weights near 1, so nothing is degenerate)."""
    with torch.no_grad():
        for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
            if not tensor.is_floating_point():
                continue
            noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float64).to(tensor.dtype)
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name and leaf == "weight" or leaf in ("q_weight", "k_weight", "scale"):
                tensor.copy_(1 + 0.1 * noise)
            else:
                tensor.copy_(std * noise)


def build_reference_model(text: dict[str, Any] | None = None, *, tokenizer=None, seed: int = 0):
    """NeMo Automodel's ``DeepseekV41ForCausalLM`` of ``text`` (default :func:`tiny_text_config`),
    text only, float64, eval mode, every weight random. Call (and run) it inside :func:`fp64_reference`."""
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

    text = tiny_text_config() if text is None else text
    config = DeepseekV41Config(text_config=dict(text), vision_config={"num_hidden_layers": 0}, dtype="float64")
    tokenizer = local_tokenizer() if tokenizer is None and text.get("engram_layer_ids") else tokenizer
    torch.manual_seed(seed)
    model = DeepseekV41ForCausalLM(config, backend=reference_backend(), tokenizer=tokenizer).double().eval()
    _randomise(model, torch.Generator().manual_seed(seed))
    return model


class DSparkOptions:
    """The recipe options :meth:`DeepseekV41Config.build_dspark_draft` reads, from a text config."""

    def __init__(self, text: dict[str, Any], num_anchors: int = 2) -> None:
        self.num_draft_layers = text["num_nextn_predict_layers"]
        self.target_layer_ids = list(text["dspark_target_layer_ids"])
        self.block_size = text["dspark_block_size"]
        self.num_anchors = num_anchors
        self.mask_token_id = text["dspark_noise_token_id"]
        self.markov_rank = text["dspark_markov_rank"]
        self.markov_head_type = "vanilla"
        self.confidence_head_alpha = 1.0
        self.confidence_head_with_markov = True
        self.confidence_head_stop_gradient = False


def build_reference_dspark(text: dict[str, Any] | None = None, *, seed: int = 1, num_anchors: int = 2):
    """NeMo Automodel's ``DeepseekV41DSparkModel`` (the ``mtp.*`` drafter) of ``text``, float64,
    eval mode, random. Call (and run) it inside :func:`fp64_reference`."""
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config

    text = tiny_text_config() if text is None else text
    config = DeepseekV41Config(text_config=dict(text), vision_config={"num_hidden_layers": 0}, dtype="float64")
    torch.manual_seed(seed)
    draft = config.build_dspark_draft(DSparkOptions(text, num_anchors)).double().eval()
    _randomise(draft, torch.Generator().manual_seed(seed))
    return draft


def reference_forward(model, input_ids: torch.Tensor, feature_layers: list[int] | None = None):
    """``(logits, features, last)``: the reference's logits ``[B, S, vocab]``; with ``feature_layers``
    also DSpark's target features (the streams entering each layer's attention mHC, averaged over the
    streams as NeMo's DSpark target does, concatenated: ``[B, S, len * hidden]``) and the final-norm
    output ``[B, S, hidden]``."""
    captured: dict[Any, torch.Tensor] = {}
    handles = []
    if feature_layers:
        modules = model.get_dspark_target_feature_modules(list(feature_layers))
        for layer, module in zip(feature_layers, modules):
            handles.append(module.register_forward_pre_hook(lambda _m, args, layer=layer: captured.__setitem__(layer, args[0])))
        handles.append(model.model.norm.register_forward_hook(lambda _m, _a, out: captured.__setitem__("norm", out)))
    try:
        logits = model(input_ids).logits
    finally:
        for handle in handles:
            handle.remove()
    if not feature_layers:
        return logits, None, None
    features = torch.cat([captured[layer].mean(dim=2) for layer in feature_layers], dim=-1)
    return logits, features, captured["norm"]


# Weight and gradient maps from the reference onto our modules (re-exported here).
from .reference_weights import (  # noqa: E402
    copy_reference_weights,
    dspark_reference_tensors,
    load_tensors,
    reference_tensors,
)
