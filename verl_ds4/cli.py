"""The ``verl-ds4`` command.

Each subcommand lives in its own module that exposes ``add_arguments(parser)`` and
``run(args) -> int``; this file only maps names to modules, so importing the CLI stays cheap
(heavy imports such as verl or megatron happen inside ``run``).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Add one line per subcommand.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "doctor": ("verl_ds4.engine.doctor_cli", "check that verl uses verl-ds4's engines and whether this stack can run DS4 with CP"),
    "verify": ("verl_ds4.cpu.verify_cli", "prove CP parity of the DS4 data path on CPU with the tiny DS4 proxy"),
    "recipe": ("verl_ds4.recipes.command", "compose, validate and print the plan of a DS4 SFT/PPO/GRPO recipe"),
    "plan": ("verl_ds4.recipes.plan_command", "show a micro-batch's CP layout (rows, padding, cost per rank), or with --fit the meshes a DS4 model fits on"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verl-ds4",
        description="DeepSeek-V4 post-training with verl on Megatron: layout, verification and recipe tools.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip())
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_module", None) is None:
        parser.print_help()
        return 2
    return int(args._module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
