"""The PyPI half of the image's pins resolves on Python 3.12 x86_64 (docker/check_pins_resolve.py).

pip's dry-run resolver, wheels only, against https://pypi.org/simple, independent of this
machine's pip configuration (no config file, no PIP_* variables: no local wheel dir, no constraints
file). The pin list is derived from docker/Dockerfile (its ARG defaults, pip install lines, -r files
and this package's own dependencies); git-sourced packages are left out. A negative control shows that
an impossible pin set is reported as not resolvable. Needs the network (PyPI); set
VERL_DS4_OFFLINE=1 to skip where there is none.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(os.environ.get("VERL_DS4_OFFLINE") == "1", reason="VERL_DS4_OFFLINE=1: no PyPI")


def _load():
    spec = importlib.util.spec_from_file_location("check_pins_resolve", REPO / "docker" / "check_pins_resolve.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


crp = _load()


def test_pin_list_comes_from_the_dockerfile_and_skips_git_sources():
    args = crp.dockerfile_args()
    pins = crp.image_pins()
    reqs = set(pins.requirements)
    for name, arg in [("torch", "TORCH_VERSION"), ("vllm", "VLLM_VERSION"), ("transformers", "TRANSFORMERS_VERSION"),
                      ("verl[verl-core]", "VERL_VERSION"), ("transformer-engine[core_cu13]", "TRANSFORMER_ENGINE_VERSION"),
                      ("nvidia-cutlass-dsl[cu13]", "CUTLASS_DSL_VERSION")]:
        assert f"{name}=={args[arg]}" in reqs, name
    assert set(pins.git) == {"megatron-core", "megatron-bridge", "fast-hadamard-transform", "nvidia-cudnn-frontend",
                             "flash-mla"}
    assert not any(r.split("[")[0].split("=")[0].split("<")[0].split(">")[0] in pins.git for r in reqs)
    assert ("flash-attn", args["FLASH_ATTN_VERSION"]) in pins.sdist_only
    assert ("transformer-engine-torch", args["TRANSFORMER_ENGINE_VERSION"]) in pins.sdist_only
    assert "einops~=0.8" in reqs and "verl==0.9.1" in reqs  # requirements-runtime.txt and pyproject.toml
    assert f"torch=={args['TORCH_VERSION']}" in pins.constraints


def test_the_machine_pip_config_is_not_used(monkeypatch):
    monkeypatch.setenv("PIP_FIND_LINKS", "/nonexistent-wheels")
    monkeypatch.setenv("PIP_CONSTRAINT", "/nonexistent-constraints.txt")
    env = crp._pip_env()
    assert env["PIP_CONFIG_FILE"] == os.devnull and env["PIP_CONSTRAINT"] == ""
    assert "PIP_FIND_LINKS" not in env


@pytest.mark.slow  # minutes: pip fetches the metadata of ~300 distributions (vLLM, torch, Ray, ...)
def test_image_pins_resolve_on_python_312():
    ok, lines, res = crp.check(timeout=900)
    report = "\n".join(lines)
    assert ok, report
    assert res.installs["torch"].split("+")[0] == crp.dockerfile_args()["TORCH_VERSION"]
    print(report)


def test_an_impossible_pin_set_is_reported_as_not_resolvable():
    # torchvision 0.25.0 is built for torch 2.10.0, so it cannot sit next to torch 2.11.0.
    res = crp.resolve(["torch==2.11.0", "torchvision==0.25.0"], timeout=600)
    assert not res.ok
    assert res.message.startswith("NOT RESOLVABLE (conflicting requirements) for CPython 3.12 x86_64"), res.message
    assert "torchvision" in res.message and "torch" in res.message
