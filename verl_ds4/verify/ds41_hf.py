"""``verl-ds4 verify --model ds41 --hf-checkpoint DIR [--cp N]``: a DeepSeek-V4.1 folder, read twice.

Ours: on each of ``N`` gloo ranks, :class:`~verl_ds4.models.ds41.mcore_model.DS41MegatronModel` at fp64 built by
the CPU builder verl's engine runs (:mod:`verl_ds4.cpu.ds41_builder`: ``AutoConfig`` of the folder, then
:func:`verl_ds4.models.ds41.released.load_checked`: our, DeepSeek's released or NeMo's names; FP8 32 x 32 /
FP4 decoded; every rule checked on the safetensors headers before a weight is read),
scoring ragged sequences packed THD with the contiguous layout
(:func:`verl_ds4.models.ds4.hf_check.run_on_cp_ranks`).

The reference: NeMo Automodel 0.7.0's ``DeepseekV41ForCausalLM`` (installed without its dependencies,
``docs/ds41-model.md``) of the folder's ``config.json`` with the folder's tokenizer, its weights read by
NeMo's own ``DeepseekV41StateDictAdapter.from_hf`` (its own FP8 / FP4 decoding, at fp64) from the folder's
tensors in DeepSeek's names (a folder in our names is renamed first with
:func:`~verl_ds4.models.ds41.released.ours_to_released`; one in NeMo's names is loaded as it is), run one
sequence per forward inside :func:`verl_ds4.models.ds41.reference.fp64_reference`.

Prints the max relative errors of logits and per-token log-probs; exit code 1 above ``--fp64-rtol``
(1e-10), 2 when the reference is not installed or the folder is refused.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

__all__ = ["compare_folder_with_nemo", "nemo_model_from_folder", "run_cli"]


class _FolderBuilder:
    """On each rank: the CPU builder verl's engine runs (``verl_ds4.cpu.ds41_builder``: the HF config read by
    ``AutoConfig`` from the folder, its transformer config, then the model and its weights), at fp64."""

    def __init__(self, folder: str):
        self.folder = folder

    def __call__(self, cp_size: int):
        from transformers import AutoConfig

        from verl_ds4.cpu import ds41_builder  # registers deepseek_v41 with AutoConfig

        hf_config = AutoConfig.from_pretrained(self.folder)
        hf_config.num_nextn_predict_layers = 0  # as verl sets it with model.mtp.enable=false (the drafter is not built)
        tf_config = ds41_builder._ds41_transformer_config(hf_config, torch.float64, {})
        model = ds41_builder._ds41_build(tf_config, hf_config, pre_process=True, post_process=True, share_embeddings=False)
        return model.eval()


def nemo_model_from_folder(folder: str | Path):
    """NeMo Automodel's V4.1 causal LM of ``folder`` at fp64, its weights read by NeMo's adapter (built inside
    :func:`~verl_ds4.models.ds41.reference.fp64_reference`; run it inside that context too)."""
    from safetensors.torch import load_file
    from transformers import PreTrainedTokenizerFast

    from verl_ds4 import ds41_facts
    from verl_ds4.models.ds41 import reference as ref
    from verl_ds4.models.ds41.folder import read_folder_config

    folder = Path(folder)
    config = read_folder_config(folder)
    text = dict(config.get("text_config") or config)
    for key in ("model_type", "quantization_config", "architectures", "vision_config", "text_config"):
        text.pop(key, None)
    tokenizer = None
    if ds41_facts.read_config(config).engram_layers:
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / ds41_facts.TOKENIZER_FILE))
    raw: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):  # outside the fp64 context: it would promote the reads
        raw.update(load_file(str(file)))
    with ref.fp64_reference():
        return _load_nemo(folder, text, tokenizer, raw)


def _load_nemo(folder: Path, text: dict, tokenizer, raw: dict):
    from verl_ds4.models.ds41 import reference as ref
    from verl_ds4.models.ds41.released import name_style, ours_to_released

    model = ref.build_reference_model(text, tokenizer=tokenizer)  # random, then every tensor overwritten below
    style = name_style(raw)
    if style == "ours":
        raw = ours_to_released({k: v for k, v in raw.items() if not k.startswith("mtp.")})
    if style == "nemo":
        native = {k: v for k, v in raw.items() if not k.startswith("mtp.")}
    else:
        adapter = model.state_dict_adapter
        saved, adapter.dtype = adapter.dtype, torch.float64
        try:
            native = adapter.from_hf(dict(raw))
        finally:
            adapter.dtype = saved
    target = model.state_dict()
    # The routers' image-token bias (vision tokens only) is not needed for text: zero where a folder lacks it.
    native.update({k: torch.zeros_like(v) for k, v in target.items() if k.endswith(".ffn.gate.bias_vl") and k not in native})
    missing = sorted(set(target) - set(native))
    unexpected = sorted(set(native) - set(target))
    if missing or unexpected:
        raise RuntimeError(f"NeMo Automodel's adapter did not give its model every tensor of {folder}: missing "
                           f"{missing[:5]}, unexpected {unexpected[:5]}")  # error-catalogue: internal: the reference disagrees with the folder
    with torch.no_grad():
        for name, tensor in target.items():
            value = native[name]
            if value.shape != tensor.shape and value.shape[1:] == tensor.shape[1:] and value.shape[0] <= tensor.shape[0]:
                tensor.zero_()  # NeMo pads an Engram table to its owner group: the logical rows come first
                tensor[: value.shape[0]].copy_(value)
            else:
                tensor.copy_(value)
    return model.double().eval()


def default_lengths(cp: int, config: dict) -> list[int]:
    from verl_ds4.models.ds41.mcore_model import ds41_transformer_config

    rows = ds41_transformer_config(config, torch.float64, 1).min_local_rows
    share = 2 * max(cp, 1) * max(rows, 8)
    return [share + 3, 5, share // 2 + 1, 11]


def compare_folder_with_nemo(folder: str | Path, cp: int = 1, seed: int = 1234, lengths: list[int] | None = None,
                             timeout: float = 600.0, reference_folder: str | Path | None = None) -> dict:
    """``{"logits": rel, "log_probs": rel, "lengths": [...], "style": names, "seconds": s}`` for ``folder`` at ``cp``.
    ``reference_folder``: the folder NeMo reads (default ``folder``), e.g. the released FP8 original of a folder
    ours wrote."""
    from verl_ds4.models.ds4.hf_check import run_on_cp_ranks
    from verl_ds4.models.ds41 import reference as ref
    from verl_ds4.models.ds41.folder import read_folder_config
    from verl_ds4.models.ds41.released import read_headers, name_style

    start = time.perf_counter()
    folder = Path(folder)
    config = read_folder_config(folder)  # a V4 folder is refused here, with the fix
    text = config.get("text_config") or config
    if lengths is None:
        lengths = default_lengths(cp, config)
    gen = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, int(text["vocab_size"]), (n,), generator=gen) for n in lengths]
    got = run_on_cp_ranks(_FolderBuilder(str(folder)), sequences, cp, timeout=timeout)
    theirs = nemo_model_from_folder(folder if reference_folder is None else reference_folder)
    with ref.fp64_reference(), torch.no_grad():
        expected = [theirs(s.view(1, -1)).logits[0] for s in sequences]

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max())

    def logp(x, s):
        return torch.log_softmax(x[:-1], -1).gather(-1, s[1:].view(-1, 1))

    return {
        "logits": max(rel(a, b) for a, b in zip(got, expected)),
        "log_probs": max(rel(logp(a, s), logp(b, s)) for a, b, s in zip(got, expected, sequences) if s.numel() > 1),
        "lengths": lengths,
        "style": name_style(read_headers(folder)[0]),
        "seconds": time.perf_counter() - start,
    }


def run_cli(args) -> int:
    """The ``verify --model ds41 --hf-checkpoint DIR`` command (``verl_ds4.verify.cli`` routes here)."""
    import json
    import warnings

    from verl_ds4.models.ds41.reference import reference_missing

    cp = 1 if args.cp is None else args.cp
    ignored = [f"--cp {args.cp} (give N >= 1)"] if cp < 1 else []
    if list(getattr(args, "dtype", ["fp64"])) != ["fp64"]:
        ignored.append(f"--dtype {' '.join(args.dtype)} (this comparison runs in fp64 only)")
    if getattr(args, "config", None) is not None:
        ignored.append("--config (the model is the folder's config.json)")
    if getattr(args, "allow_mtp_skip", False):
        ignored.append("--allow-mtp-skip (the V4.1 text model never builds the drafter; its mtp.* is counted and skipped)")
    if getattr(args, "no_layout_checks", False):
        ignored.append("--no-layout-checks (there are no layout rows here)")
    if ignored:
        print(f"verify --model ds41 --hf-checkpoint: options this comparison would ignore: {'; '.join(ignored)}. Drop them.",
              file=sys.stderr)
        return 2
    missing = reference_missing()
    if missing:
        print(f"verify --model ds41: {missing}", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    try:
        result = compare_folder_with_nemo(args.hf_checkpoint, cp=cp, seed=args.seed, timeout=args.timeout)
    except ValueError as e:  # the folder refused at start-up (model_type, a rule, a tensor): the message names the fix
        print(f"verify --model ds41 --hf-checkpoint: {e}", file=sys.stderr)  # error-catalogue: passes on a message catalogued where it is built
        return 2
    ok = result["logits"] <= args.fp64_rtol and result["log_probs"] <= args.fp64_rtol
    print(f"DeepSeek-V4.1 {args.hf_checkpoint} ({result['style']} names): our Megatron model at CP={cp} vs NeMo "
          f"Automodel reading the same folder (fp64), lengths {result['lengths']}")
    print(f"  logits     max rel error {result['logits']:.3e}  (tol {args.fp64_rtol:g})")
    print(f"  log-probs  max rel error {result['log_probs']:.3e}  (tol {args.fp64_rtol:g})")
    print(f"{'PASSED' if ok else 'FAILED'} in {result['seconds']:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": "ds41", "hf_checkpoint": str(args.hf_checkpoint), "cp": cp, "passed": ok, **result}, f, indent=2)
    return 0 if ok else 1
