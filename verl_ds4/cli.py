"""The ``verl-ds4`` command.

Each subcommand lives in its own module that exposes ``add_arguments(parser)`` and
``run(args) -> int``; this file only maps names to modules, so importing the CLI stays cheap
(heavy imports such as verl or megatron happen inside ``run``).

The console shows the command's own output only: Python warnings and log records of the libraries
it imports (verl, Megatron, Ray, ...) go to a log file (``$VERL_DS4_LOG_DIR``, default
``~/.cache/verl-ds4``, one ``cli-<command>.log`` per subcommand, rewritten each run) and one line
at the end says where; ``--verbose`` prints them on the console instead.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys
import warnings
from pathlib import Path

# name -> (module, one-line help). Add one line per subcommand.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "doctor": ("verl_ds4.engine.doctor_cli", "check that verl uses verl-ds4's engines and whether this stack can run DS4 with CP"),
    "verify": ("verl_ds4.verify.cli", "prove CP parity of the full tiny DS4 on CPU (loss, log-probs, gradients vs CP=1; --device cuda: on GPUs vs the fp64 CPU reference), or compare an HF folder with transformers; --model ds41: the tiny DeepSeek-V4.1 vs CP=1 and NeMo Automodel"),
    "recipe": ("verl_ds4.recipes.command", "compose, validate (memory included) and print the plan of a DS4 SFT/PPO/GRPO recipe"),
    "plan": ("verl_ds4.recipes.plan_command", "show a micro-batch's CP layout (rows, padding, cost per rank), or with --fit the meshes a DS4 model fits on"),
}


def log_path(command: str) -> Path:
    """Where a subcommand's third-party warnings and log records go."""
    root = os.environ.get("VERL_DS4_LOG_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "verl-ds4")
    return Path(root) / f"cli-{command}.log"


@contextlib.contextmanager
def third_party_output_to(path: Path):
    """Route Python warnings and every log record to ``path`` while the command runs; yields a counter."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, mode="w", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    counted = {"records": 0}

    class _Count(logging.Filter):
        def filter(self, record):
            counted["records"] += 1
            return True

    handler.addFilter(_Count())
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    # Libraries that call logging.basicConfig find the root configured and add no console handler.
    logging.basicConfig(handlers=[handler], level=logging.INFO, force=True)
    logging.captureWarnings(True)
    try:  # forked workers (verify's gloo ranks) inherit this configuration
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            yield counted
    finally:
        logging.captureWarnings(False)
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        handler.close()


def _quiet_progress_bars() -> None:
    """No progress bars of the Hugging Face libraries (transformers' "Loading weights" bar of ``verify
    --hf-checkpoint``) on the console: they read this variable when imported, and ones imported already are
    told directly."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].utils.disable_progress_bars()
    if "transformers" in sys.modules:
        importlib.import_module("transformers.utils.logging").disable_progress_bar()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verl-ds4",
        description="DeepSeek-V4 post-training with verl on Megatron: layout, verification and recipe tools.",
    )
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="print the libraries' warnings and logs on the console (default: a log file, named at the end)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                       help="print the libraries' warnings and logs on the console")
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_module", None) is None:
        parser.print_help()
        return 2
    if args.verbose:
        return int(args._module.run(args) or 0)
    path = log_path(args.command)
    _quiet_progress_bars()
    with third_party_output_to(path) as counted:
        rc = int(args._module.run(args) or 0)
    if counted["records"]:
        print(f"({counted['records']} warnings / log lines of the libraries in {path}; --verbose prints them)", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
