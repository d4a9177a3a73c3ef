"""Check that a verl-ds4 image holds exactly the pinned stack.

Run at the end of ``docker build`` (``--versions-only``: metadata only, no GPU needed) and in a
running container on a GPU node (default: also imports the CUDA packages and runs one tiny kernel
each), e.g. ``docker run --gpus all verl-ds4 python docker/verify_image.py``.

The pins come from the two files the Dockerfile writes from its build arguments:
``$PIP_CONSTRAINT`` (``name==version`` lines) and ``/opt/verl-ds4-git-pins.txt``
(``name commit`` lines, checked against pip's ``direct_url.json`` record of the installed commit).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import os
import sys

GIT_PINS_FILE = "/opt/verl-ds4-git-pins.txt"

# Modules that must import in the image (on a GPU node): the DS4 training and rollout stack.
MODULES = [
    "torch",
    "vllm",
    "transformers",
    "transformer_engine.pytorch",
    "megatron.core",
    "megatron.bridge",
    "fast_hadamard_transform",
    "cudnn",
    "flash_mla",
    "flash_attn",
    "verl",
    "verl_ds4",
]


def _read_lines(path: str) -> list[str]:
    with open(path) as f:
        return [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]


def check_versions(constraints_path: str, git_pins_path: str) -> list[str]:
    problems = []
    for line in _read_lines(constraints_path):
        name, _, want = line.partition("==")
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            problems.append(f"{name}: not installed (pinned {want})")
            continue
        # Local version labels (e.g. torch 2.11.0+cu130) still match the public version.
        if have.split("+")[0] != want:
            problems.append(f"{name}: installed {have}, pinned {want}")
    for line in _read_lines(git_pins_path):
        name, commit = line.split()
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            problems.append(f"{name}: not installed (pinned commit {commit})")
            continue
        raw = dist.read_text("direct_url.json")
        have = json.loads(raw).get("vcs_info", {}).get("commit_id") if raw else None
        if have != commit:
            problems.append(f"{name}: installed from commit {have}, pinned {commit}")
    return problems


def check_imports() -> list[str]:
    problems = []
    for module in MODULES:
        try:
            importlib.import_module(module)
        except Exception as e:  # report every failure, not only the first
            problems.append(f"import {module}: {type(e).__name__}: {e}")
    if problems:
        return problems
    import torch

    if not torch.cuda.is_available():
        return ["torch.cuda.is_available() is False: run this on a GPU node (docker run --gpus all ...)"]
    from fast_hadamard_transform import hadamard_transform

    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    y = hadamard_transform(x, scale=256**-0.5)
    if not torch.isfinite(y).all():
        problems.append("fast_hadamard_transform returned non-finite values")
    print(f"GPU: {torch.cuda.get_device_name()} capability {torch.cuda.get_device_capability()}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versions-only", action="store_true", help="check installed versions only (no GPU)")
    parser.add_argument("--constraints", default=os.environ.get("PIP_CONSTRAINT", ""), help="pip constraints file")
    parser.add_argument("--git-pins", default=GIT_PINS_FILE, help="file of 'name commit' lines")
    args = parser.parse_args(argv)
    if not args.constraints:
        parser.error("no constraints file: set PIP_CONSTRAINT or pass --constraints (the image sets both files)")

    problems = check_versions(args.constraints, args.git_pins)
    if not args.versions_only and not problems:
        problems = check_imports()
    for p in problems:
        print(f"verify_image: {p}", file=sys.stderr)
    if problems:
        print("verify_image: FAILED; rebuild the image (see docker/README.md)", file=sys.stderr)
        return 1
    print("verify_image: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
