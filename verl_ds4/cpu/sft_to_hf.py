"""Turn a CPU SFT checkpoint (verl's Megatron dist-checkpoint of the tiny DS4 or V4.1) into a model folder.

The hand-over from the SFT job to the RL jobs: verl's SFT trainer saves
``global_step_N/model/dist_ckpt`` (Megatron dist-checkpointing, torch DCP files, keys = the
``DS4Model`` state dict); the PPO / GRPO launcher reads an HF folder
(``actor_rollout_ref.model.path``: ``config.json`` + ``model.safetensors`` + the tokenizer),
from which actor, reference, critic trunk and the ``cpu_demo`` rollout all start.

:func:`convert_sft_checkpoint` reads the DCP files into one state dict (PyTorch's
``dcp_to_torch_save``, one process, no process group), loads it into a ``DS4Model`` built from the
SFT run's model folder (the folder's own weights first, so names, shapes and dtypes are checked;
every tensor of the folder must be in the checkpoint), and writes the folder with
:func:`verl_ds4.models.ds4.hf_checkpoint.save_hf_checkpoint` plus the tokenizer files and a
``generation_config.json`` whose ``eos_token_id`` also lists DS4's end-of-sentence token (the one
the DS4 chat encoding ends an assistant turn with, and that SFT teaches), so the rollout stops there.

DeepSeek-V4.1 (``MODEL=ds41``; the model folder's ``model_type`` is ``deepseek_v41``): the checkpoint's
keys are ``DS41MegatronModel``'s, which are the V4.1 folder's own names
(:mod:`verl_ds4.models.ds41.folder`); the folder is read with ``folder.load_folder`` (every V4.1 rule and
tensor checked), the checkpoint's weights copied in and written with ``folder.save_folder`` beside the
tokenizer files (``tokenizer.json`` first: Engram's tables come from it) and the same generation config.
The kind of model is taken from the folder; ``--model ds4|ds41`` states it, and a folder or a checkpoint
of the other kind (V4's checkpoints have ``decoder.hc_head``, V4.1's single-pass mHC has none) is
refused before anything is written.

    python -m verl_ds4.cpu.sft_to_hf --checkpoint runs/ds4_sft_cpu/checkpoints [--step N] \
        --model-dir runs/ds4_sft_cpu/assets/model --out runs/ds4_sft_cpu/hf [--model ds4|ds41]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

__all__ = ["MODEL_KINDS", "SFTConversionError", "checkpoint_kind", "convert_sft_checkpoint", "folder_kind", "resolve_step_dir"]

#: ``--model`` values and the HF ``model_type`` of their folders.
MODEL_KINDS = {"ds4": "deepseek_v4", "ds41": "deepseek_v41"}

#: Files of the model folder copied beside the converted weights (tokenizer + chat template).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class SFTConversionError(ValueError):
    """The checkpoint or the model folder is not what the conversion needs."""


def resolve_step_dir(checkpoint: str | Path, step: int | None = None) -> Path:
    """``checkpoint`` itself if it is a ``global_step_N`` folder, else its step ``step`` (default: the
    latest, from verl's ``latest_checkpointed_iteration.txt``)."""
    path = Path(checkpoint)
    if (path / "model" / "dist_ckpt").is_dir():
        return path
    if step is None:
        tracker = path / "latest_checkpointed_iteration.txt"
        if not tracker.is_file():
            raise SFTConversionError(
                f"{path} is neither a global_step_N folder (with model/dist_ckpt) nor a checkpoint folder with "
                "latest_checkpointed_iteration.txt: pass the SFT run's trainer.default_local_dir or one of its steps."
            )
        step = int(tracker.read_text().strip())
    step_dir = path / f"global_step_{step}"
    if not (step_dir / "model" / "dist_ckpt").is_dir():
        raise SFTConversionError(f"{step_dir}/model/dist_ckpt does not exist: no model checkpoint at step {step}.")
    return step_dir


def _read_dcp(dist_ckpt: Path) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "model.pt"
        dcp_to_torch_save(str(dist_ckpt), str(out))
        state = torch.load(out, map_location="cpu", weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}


def folder_kind(model_dir: Path) -> str | None:
    """``ds4`` / ``ds41`` from the folder's ``config.json`` ``model_type`` (None: neither, or no config)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    model_type = json.loads(path.read_text()).get("model_type")
    return next((kind for kind, mt in MODEL_KINDS.items() if mt == model_type), None)


def checkpoint_kind(keys) -> str | None:
    """``ds4`` / ``ds41`` from a checkpoint's model keys: V4 collapses its mHC streams with ``decoder.hc_head``,
    V4.1's single-pass mHC (``attn_hc`` / ``mlp_hc`` per layer) has no head. None: neither (proxy, dense)."""
    keys = list(keys)
    if any(k.startswith("decoder.hc_head.") for k in keys):
        return "ds4"
    if any(".attn_hc." in k for k in keys):
        return "ds41"
    return None


def _check_kinds(requested: str | None, model_dir: Path, step_dir: Path, saved_keys) -> str | None:
    """The model kind the conversion writes; refuses a folder or a checkpoint of another kind than asked."""
    folder = folder_kind(model_dir)
    if requested is not None and requested not in MODEL_KINDS:
        raise SFTConversionError(f"--model={requested!r}: expected one of {sorted(MODEL_KINDS)}.")
    if requested is not None and folder is not None and folder != requested:
        raise SFTConversionError(
            f"--model={requested} but --model-dir {model_dir} is a {folder} folder (model_type {MODEL_KINDS[folder]!r}): "
            f"pass --model {folder}, or the {requested} model folder the SFT run started from (its WORK_DIR/assets/model)."
        )
    kind = requested or folder
    ckpt = checkpoint_kind(saved_keys)
    if kind in MODEL_KINDS and ckpt is not None and ckpt != kind:
        raise SFTConversionError(
            f"--checkpoint {step_dir} holds a {ckpt} model (MODEL={ckpt} SFT run) but the conversion was asked for {kind} "
            f"(--model / --model-dir {model_dir}): pass that run's own model folder (its WORK_DIR/assets/model) and "
            f"--model {ckpt}, or the checkpoint of a MODEL={kind} run."
        )
    return kind


def _ds4_eos_generation_config(model_dir: Path, out: Path) -> list[int]:
    from transformers import AutoTokenizer, GenerationConfig
    from verl.utils.tokenizer.deepseek import EOS_TOKEN

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    config = json.loads((model_dir / "config.json").read_text())
    ids = config.get("eos_token_id")
    ids = [] if ids is None else list(ids) if isinstance(ids, list) else [ids]
    ds4_eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    if ds4_eos is None or ds4_eos == tokenizer.unk_token_id:
        raise SFTConversionError(f"the tokenizer of {model_dir} has no {EOS_TOKEN!r} token (DS4's end of sentence).")
    ids = sorted({*map(int, ids), int(ds4_eos)})
    GenerationConfig(bos_token_id=config.get("bos_token_id"), eos_token_id=ids,
                     pad_token_id=config.get("pad_token_id")).save_pretrained(str(out))
    return ids


def convert_sft_checkpoint(checkpoint: str | Path, model_dir: str | Path, out: str | Path, *, step: int | None = None,
                           model: str | None = None) -> dict:
    """Write the model folder ``out`` (HF DS4, or V4.1 in our names) from an SFT checkpoint; returns what was
    done (paths, step, counts). ``model`` (``ds4`` / ``ds41``; default: the kind of ``model_dir``) is checked
    against the folder and the checkpoint.

    The model is built in a child process on a one-rank gloo group (Megatron's modules need its
    parallel state); the caller's process is left alone.
    """
    from verl_ds4.mcore.distributed import run_distributed

    step_dir = resolve_step_dir(checkpoint, step)  # a clear error before any process starts
    if model is not None and model not in MODEL_KINDS:
        raise SFTConversionError(f"model={model!r}: expected one of {sorted(MODEL_KINDS)}.")
    [result] = run_distributed(_convert_on_rank, world_size=1, args=(str(step_dir), str(model_dir), str(out), model))
    if isinstance(result, str):
        raise SFTConversionError(result)
    return result


def _convert_on_rank(rank: int, world: int, step_dir: str, model_dir: str, out: str, model: str | None = None):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    try:
        saved = _read_dcp(Path(step_dir) / "model" / "dist_ckpt")
        kind = _check_kinds(model, Path(model_dir), Path(step_dir), saved)
        convert = _convert_ds41 if kind == "ds41" else _convert
        return convert(Path(step_dir), Path(model_dir), Path(out), saved)
    except SFTConversionError as err:
        return str(err)
    finally:
        parallel_state.destroy_model_parallel()


def _convert(step_dir: Path, model_dir: Path, out: Path, saved: dict) -> dict:
    import torch

    from verl_ds4.models.ds4.hf_checkpoint import load_hf_checkpoint, read_config, save_hf_checkpoint

    read_config(model_dir)  # a DS4 folder, or a clear error
    if not any(model_dir.glob("*.safetensors")):
        raise SFTConversionError(
            f"{model_dir} has no safetensors: the conversion needs the full tiny DS4's folder the SFT run started "
            "from (MODEL=ds4; the attention-only proxy has no HF weights to hand over)."
        )
    model, info = load_hf_checkpoint(model_dir, dtype=torch.float32)
    ours = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    changed = _copy_checkpoint_into(ours, saved, step_dir, model_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_hf_checkpoint(model, out, info)
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, out / name)
    return _finish(step_dir, model_dir, out, len(ours), changed, "deepseek_v4")


def _convert_ds41(step_dir: Path, model_dir: Path, out: Path, saved: dict) -> dict:
    """The V4.1 folder: ``folder.load_folder`` (every rule and tensor checked), the checkpoint's weights, ``save_folder``."""
    from safetensors import safe_open

    from verl_ds4.models.ds41.folder import WEIGHTS, load_folder, read_folder_config, save_folder

    try:
        config = read_folder_config(model_dir)
    except ValueError as err:
        raise SFTConversionError(f"--model-dir {model_dir}: {err}") from err
    if not (model_dir / WEIGHTS).is_file():
        raise SFTConversionError(f"{model_dir} has no {WEIGHTS}: pass the V4.1 folder the SFT run started from (its WORK_DIR/assets/model).")
    with safe_open(str(model_dir / WEIGHTS), framework="pt") as f:  # keep the folder's floating dtype
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    import torch

    dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
    floating = [dtype[d] for d in dtypes if d in dtype]
    model = load_folder(model_dir, dtype=floating[0] if len(floating) == 1 else torch.float32)
    ours = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    changed = _copy_checkpoint_into(ours, saved, step_dir, model_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:  # before save_folder: its final check reads tokenizer.json (Engram)
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, out / name)
    save_folder(model, out, config)
    from verl_ds4.models.ds41.hf_config import register_auto_config

    register_auto_config()  # AutoTokenizer reads config.json: transformers has no deepseek_v41
    return _finish(step_dir, model_dir, out, len(ours), changed, "deepseek_v41")


def _copy_checkpoint_into(ours: dict, saved: dict, step_dir: Path, model_dir: Path) -> int:
    """Copy ``saved`` into the model's tensors ``ours`` (same keys and shapes, or a clear error); how many changed."""
    import torch

    missing = sorted(set(ours) - set(saved))
    unexpected = sorted(set(saved) - set(ours))
    if missing or unexpected:
        raise SFTConversionError(
            f"{step_dir}: the checkpoint does not match the model of {model_dir}: missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}. "
            "Pass the model folder the SFT run trained (its WORK_DIR/assets/model)."
        )
    bad = [k for k in ours if tuple(ours[k].shape) != tuple(saved[k].shape)]
    if bad:
        raise SFTConversionError(f"{step_dir}: shapes differ from {model_dir} for {bad[:5]}.")
    changed = sum(int(not torch.equal(saved[k].to(v.dtype), v)) for k, v in ours.items())
    with torch.no_grad():
        for key, value in ours.items():
            value.copy_(saved[key].to(value.dtype))
    return changed


def _finish(step_dir: Path, model_dir: Path, out: Path, tensors: int, changed: int, model_type: str) -> dict:
    eos_ids = _ds4_eos_generation_config(model_dir, out)
    step_value = int(step_dir.name.rpartition("_")[2]) if step_dir.name.startswith("global_step_") else None
    result = {"out": str(out), "step_dir": str(step_dir), "step": step_value, "tensors": tensors,
              "tensors_changed_by_sft": changed, "eos_token_id": eos_ids, "model_type": model_type}
    (out / "verl_ds4_sft_source.json").write_text(json.dumps(result, indent=2) + "\n")
    from verl_ds4.ckpt_manifest import write_manifest

    write_manifest(out, global_step=step_value, written_by="verl-ds4 sft_to_hf")  # last: the folder is complete
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m verl_ds4.cpu.sft_to_hf",
        description="Convert the CPU SFT job's Megatron dist-checkpoint (tiny DS4 or DeepSeek-V4.1) into a model folder "
                    "(config.json + model.safetensors + tokenizer + generation_config.json: HF DS4, or V4.1 in our names) "
                    "that the PPO/GRPO launcher reads as actor_rollout_ref.model.path.",
    )
    parser.add_argument("--checkpoint", required=True,
                        help="the SFT run's checkpoint folder (trainer.default_local_dir) or one global_step_N in it")
    parser.add_argument("--step", type=int, help="which global_step_N (default: the latest)")
    parser.add_argument("--model-dir", required=True, help="the model folder the SFT run started from (WORK_DIR/assets/model)")
    parser.add_argument("--out", required=True, help="the folder to write")
    parser.add_argument("--model", choices=sorted(MODEL_KINDS),
                        help="the SFT run's MODEL (default: the kind of --model-dir); a folder or checkpoint of another kind is refused")
    args = parser.parse_args(argv)
    try:
        result = convert_sft_checkpoint(args.checkpoint, args.model_dir, args.out, step=args.step, model=args.model)
    except SFTConversionError as err:
        parser.exit(2, f"error: {err}\n")
    kind = "DeepSeek-V4.1 folder" if result["model_type"] == "deepseek_v41" else "HF DS4 folder"
    print(f"{result['out']}: {kind} from {result['step_dir']} ({result['tensors']} tensors, "
          f"{result['tensors_changed_by_sft']} changed by SFT; eos ids {result['eos_token_id']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
