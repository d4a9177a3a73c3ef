"""Check this Python environment: does verl use verl-ds4's engines, and can this stack run DS4 with CP?

Reports (1) whether verl's EngineRegistry resolves ``language_model`` / ``value_model`` on
``strategy=megatron`` to verl-ds4's engines (on NVIDIA GPUs, and on this machine's platform),
(2) the installed versions of verl, megatron-core, Megatron-Bridge, TransformerEngine, vLLM and
torch, (3) whether this stack can run DeepSeek-V4 with context parallelism, and what is missing, and
(4) the same for DeepSeek-V4.1: Megatron-LM dev's CSA2 core attention (and whether it takes CP > 1),
its V4.1 model package, the ``dsv4_version`` switch and Megatron-Bridge's V4.1 bridge.

Exit status: 0 when the engines resolve to verl-ds4's; 1 otherwise; with ``--require-ds4`` also 1
when the stack cannot run DS4 with CP, with ``--require-ds41`` when it cannot run V4.1 with CP.

``--checkpoint DIR`` checks checkpoints instead (:mod:`verl_ds4.engine.ckpt_doctor`): every file against
its manifest with checksums, one line per file; exit 0 when every checkpoint is intact, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import sys

#: distribution names to report (first one installed wins)
PACKAGES = {
    "verl": ("verl",),
    "verl-ds4": ("verl-ds4",),
    "megatron-core": ("megatron-core", "megatron_core"),
    "Megatron-Bridge": ("megatron-bridge", "megatron_bridge"),
    "TransformerEngine": ("transformer-engine", "transformer_engine", "transformer-engine-torch"),
    "vLLM": ("vllm",),
    "torch": ("torch",),
}
MIN_TRANSFORMER_ENGINE = (2, 9)
DS4_ATTENTION_MODULE = "megatron.core.transformer.experimental_attention_variant.deepseek_v4_hybrid_attention"
DS4_BRIDGE_MODULE = "megatron.bridge.models.deepseek.deepseek_v4_bridge"
#: The V4.1 pieces of megatron.core on the dev branch (source read at e80d15ffa5 / 02ab972cd1, see
#: verl_ds4/mcore/requirements.py) and Megatron-Bridge's V4.1 bridge (which asks for the dev commit
#: 0d4c86d17 of PR #7503, or a descendant).
DS41_CSA2_MODULE = "megatron.core.transformer.experimental_attention_variant.csa2"
DS41_CSA2_CLASSES = ("CompressedSparseAttention2", "CSA2Attention")
DS41_MODEL_MODULE = "megatron.core.models.deepseek_v41"
DS41_CONFIG_MODULE = "megatron.core.transformer.transformer_config"
DS41_BRIDGE_MODULE = "megatron.bridge.models.deepseek.deepseek_v41_bridge"
#: Phrases of early CSA2 commits that refuse context parallelism.
DS41_CP_REFUSALS = ("requires TP=CP=1", "currently requires CP=1", "supports unpacked sequences with CP=1")
DS41_FIX = ("install a megatron.core with V4.1 (the dev commit 0d4c86d17 of PR #7503, or a descendant) and a "
            "Megatron-Bridge with deepseek_v41_bridge; docker/README.md says why the image does not pin them yet")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="only check checkpoints: every file of each global_step_N in DIR (or of one checkpoint folder) "
        "against its manifest, with checksums; exit 1 if one is damaged",
    )
    parser.add_argument(
        "--require-ds4",
        action="store_true",
        help="exit 1 unless this stack can run DeepSeek-V4 with context parallelism on GPUs",
    )
    parser.add_argument(
        "--require-ds41",
        action="store_true",
        help="exit 1 unless this stack can run DeepSeek-V4.1 with context parallelism on GPUs",
    )


def installed_version(names) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _version_tuple(text: str | None) -> tuple[int, ...]:
    parts = []
    for piece in (text or "").split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
        if len(parts) == 2:
            break
    return tuple(parts)


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


CPU_ENGINES_HOW = ("verl-ds4's CPU engines register with VERL_PLATFORM=cpu "
                   "VERL_USE_EXTERNAL_MODULES=verl_ds4.cpu.platform,verl_ds4.cpu.engine (the CPU launchers set them)")


def _has_accelerator() -> bool:
    try:
        import torch
    except ImportError:
        return False
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())
    return bool(torch.cuda.is_available())


def this_machine(get_device_name, get_vendor) -> tuple[str, str, str]:
    """``(device, vendor, label)`` of the engines verl would pick here.

    verl falls back to its CUDA platform when no platform is selected, also on a machine without an
    accelerator; such a machine is labelled ``cpu`` and looked up as verl-ds4's CPU platform (``VERL_PLATFORM=cpu``)
    would be. ``VERL_ENGINE_DEVICE`` / ``VERL_ENGINE_VENDOR`` are taken as they are.
    """
    device = os.getenv("VERL_ENGINE_DEVICE") or get_device_name()
    vendor = os.getenv("VERL_ENGINE_VENDOR") or get_vendor()
    if device == "cuda" and not os.getenv("VERL_ENGINE_DEVICE") and not _has_accelerator():
        env_vendor = os.getenv("VERL_ENGINE_VENDOR")
        if env_vendor:  # the user's vendor stands; only the device falls back
            return "cpu", env_vendor, f"this machine (cpu/{env_vendor}, no accelerator)"
        return "cpu", "cpu", "this machine (cpu, no accelerator)"
    return device, vendor, f"this machine ({device}/{vendor})"


def engine_resolution() -> tuple[dict[str, str], str | None]:
    """``({label: class path}, error)`` of verl's registry for megatron, NVIDIA GPUs and this platform."""
    rows: dict[str, str] = {}
    error = None
    try:
        from verl_ds4.engine import plugin

        plugin.self_check()  # imports verl (loading the verl.plugins entry points) and verl's Megatron engine
    except Exception as exc:  # noqa: BLE001 - reported
        error = f"{type(exc).__name__}: {exc}"
    try:
        from verl.utils.device import get_device_name, get_vendor
        from verl.workers.engine import EngineRegistry
    except Exception as exc:  # noqa: BLE001
        return rows, error or f"{type(exc).__name__}: {exc}"
    for device, vendor, where in (("cuda", "nvidia", "NVIDIA GPU"), this_machine(get_device_name, get_vendor)):
        for model_type in ("language_model", "value_model"):
            saved = {k: os.environ.get(k) for k in ("VERL_ENGINE_DEVICE", "VERL_ENGINE_VENDOR")}
            os.environ["VERL_ENGINE_DEVICE"], os.environ["VERL_ENGINE_VENDOR"] = device, vendor
            try:
                cls = EngineRegistry.get_engine_cls(model_type, "megatron")
                rows[f"{where}: {model_type}"] = f"{cls.__module__}.{cls.__qualname__}"
            except Exception as exc:  # noqa: BLE001
                rows[f"{where}: {model_type}"] = f"none ({type(exc).__name__}: {exc})"
                if device == "cpu" and not os.getenv("VERL_USE_EXTERNAL_MODULES"):
                    rows[f"{where}: {model_type}"] = f"none yet: {CPU_ENGINES_HOW}"
            finally:
                for key, value in saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
    return rows, error


def ds4_cp_missing(versions: dict[str, str | None]) -> list[str]:
    """What this stack lacks to run DeepSeek-V4 with context parallelism on GPUs (empty: nothing)."""
    missing = []
    if versions.get("megatron-core") is None:
        missing.append("megatron-core is not installed")
    else:
        if not _module_exists(DS4_ATTENTION_MODULE):
            missing.append(
                "Megatron-Core has no DS4 hybrid attention (experimental_attention_variant='dsv4_hybrid'); "
                "install Megatron-LM dev (e.g. d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1, see docker/)"
            )
        try:

            from verl_ds4.mcore.megatron_api import installed_api

            if not installed_api().can_tell_attention:
                missing.append(
                    "megatron.core has no CP layout API: PackedSeqParams has no cp_partition_mode (dev's spelling) and "
                    "TransformerConfig has no attention_cp_layout (main's): contiguous CP cannot be signalled"
                )
        except Exception as exc:  # noqa: BLE001
            missing.append(f"megatron.core does not import ({type(exc).__name__}: {exc})")
    if versions.get("Megatron-Bridge") is None:
        missing.append("Megatron-Bridge is not installed (it maps HF DeepseekV4ForCausalLM onto Megatron)")
    elif not _module_exists(DS4_BRIDGE_MODULE):
        missing.append("Megatron-Bridge has no DeepSeek-V4 bridge (use 0.6.x or 7e1ba282832a, see docker/)")
    te = versions.get("TransformerEngine")
    if te is None:
        missing.append(f"TransformerEngine >= {'.'.join(map(str, MIN_TRANSFORMER_ENGINE))} is not installed")
    elif _version_tuple(te) < MIN_TRANSFORMER_ENGINE:
        missing.append(f"TransformerEngine {te} < {'.'.join(map(str, MIN_TRANSFORMER_ENGINE))}")
    for module, what in (("fast_hadamard_transform", "fast_hadamard_transform"), ("cutlass", "nvidia-cutlass-dsl")):
        if not _module_exists(module):
            missing.append(f"{what} is not installed")
    try:
        import torch

        if not torch.cuda.is_available():
            missing.append("no CUDA GPU visible (DS4 kernels need SM90 / SM100)")
        elif torch.cuda.get_device_capability()[0] < 9:
            missing.append(f"GPU compute capability {torch.cuda.get_device_capability()} < 9.0 (needs SM90 / SM100)")
    except Exception as exc:  # noqa: BLE001
        missing.append(f"torch does not import ({exc})")
    return missing


def module_source(name: str) -> str | None:
    """The source text of module ``name`` (a package: its ``__init__`` and every ``.py`` in it), or ``None``
    when it is not installed. Imports only the parent packages (``find_spec``)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return None
    paths = [spec.origin]
    if spec.submodule_search_locations:
        folder = os.path.dirname(spec.origin)
        paths += sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".py") and f != "__init__.py")
    texts = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                texts.append(f.read())
        except OSError:
            continue
    return "\n".join(texts)


def ds41_cp_report(ds4_missing: list[str], source_of=module_source) -> tuple[list[str], list[str]]:
    """``(found, missing)``: the V4.1 pieces this stack has, and what it lacks to run V4.1 with CP on GPUs.

    V4.1 runs on V4's stack (``ds4_missing``: the DS4 hybrid attention, the CP layout API, TE, kernels, GPU)
    plus Megatron-LM dev's CSA2 core attention taking CP > 1, its V4.1 model package, the ``dsv4_version``
    switch, and Megatron-Bridge's V4.1 bridge. ``source_of`` reads a module's source (tests pass fakes).
    """
    found, missing = [], list(ds4_missing)
    csa2 = source_of(DS41_CSA2_MODULE)
    classes = [c for c in DS41_CSA2_CLASSES if csa2 and f"class {c}(" in csa2]
    if not classes:
        missing.append(f"Megatron-Core has no V4.1 CSA2 core attention ({DS41_CSA2_MODULE}: "
                       f"{' / '.join(DS41_CSA2_CLASSES)})")
    else:
        refusal = next((p for p in DS41_CP_REFUSALS if p in csa2), None)
        if refusal:
            missing.append(f"{DS41_CSA2_MODULE}.{classes[0]} refuses context parallelism on this commit "
                           f"('{refusal}')")
        else:
            found.append(f"{DS41_CSA2_MODULE}.{classes[0]} (contiguous CP, told by PackedSeqParams.cp_partition_mode)")
    config = source_of(DS41_CONFIG_MODULE)
    if config and "dsv4_version" in config:
        found.append("TransformerConfig.dsv4_version")
    else:
        missing.append("TransformerConfig has no dsv4_version (the V4.1 switch)")
    if source_of(DS41_MODEL_MODULE) is not None:
        found.append(DS41_MODEL_MODULE)
    else:
        missing.append(f"Megatron-Core has no {DS41_MODEL_MODULE} (V4.1 model, Engram, DSpark)")
    if source_of(DS41_BRIDGE_MODULE) is not None:
        found.append(DS41_BRIDGE_MODULE)
    else:
        missing.append(f"Megatron-Bridge has no DeepSeek-V4.1 bridge ({DS41_BRIDGE_MODULE}: maps HF "
                       "DeepseekV41ForCausalLM)")
    return found, missing


def run(args: argparse.Namespace) -> int:
    if getattr(args, "checkpoint", None):
        from verl_ds4.engine.ckpt_doctor import check_checkpoints

        return check_checkpoints(args.checkpoint)
    versions = {label: installed_version(names) for label, names in PACKAGES.items()}
    print(f"verl-ds4 doctor  (python {sys.version.split()[0]}, {sys.executable})")
    print("\nInstalled versions:")
    for label, version in versions.items():
        print(f"  {label:18s} {version or 'not installed'}")

    print("\nverl engine registry, strategy=megatron:")
    rows, error = engine_resolution()
    ours = True
    width = max((len(label) for label in rows), default=0)
    for label, cls in rows.items():
        mark = "ok " if cls.startswith("verl_ds4.") else "-- "
        print(f"  {mark}{label:{width}s} -> {cls}")
        if label.startswith("NVIDIA GPU") and not cls.startswith("verl_ds4."):
            ours = False
    if error:
        ours = False
        print(f"  plugin self-check FAILED: {error}")
    elif not rows:
        ours = False
    else:
        print("  plugin self-check: ok (verl.plugins entry point 'verl_ds4' registers the engines)")
    if os.getenv("VERL_USE_EXTERNAL_PLUGINS", "auto").strip().lower() == "none":
        print("  note: VERL_USE_EXTERNAL_PLUGINS=none stops verl from loading the plugin in training processes")

    print("\nMegatron-Core CP layout API:")
    try:
        from verl_ds4.mcore.megatron_api import installed_api

        print(f"  {installed_api().kind}: {installed_api().describe()}")
    except Exception as exc:  # noqa: BLE001 - reported
        print(f"  unknown ({type(exc).__name__}: {exc})")

    missing = ds4_cp_missing(versions)
    print("\nDeepSeek-V4 with context parallelism on this stack:")
    if missing:
        print("  NO, missing:")
        for item in missing:
            print(f"    - {item}")
        print("  (attention modules that declare required_cp_partition_mode, e.g. a pure-PyTorch DS4 attention,")
        print("   can still use the contiguous layout with CP on this stack)")
    else:
        print("  yes")
    found41, missing41 = ds41_cp_report(missing)
    print("\nDeepSeek-V4.1 with context parallelism on this stack:")
    print(f"  {'yes' if not missing41 else 'NO'}; V4.1 modules found: {', '.join(found41) or 'none'}")
    if missing41:
        print("  missing:")
        for item in missing41:
            print(f"    - {item}")
        print(f"  fix: {DS41_FIX}")
        print("  (verl-ds4's own V4.1 model, verl_ds4.models.ds41, declares the contiguous layout and runs with CP on CPU)")
    status = 0 if ours else 1
    if args.require_ds4 and missing:
        status = 1
    if getattr(args, "require_ds41", False) and missing41:
        status = 1
    return status
