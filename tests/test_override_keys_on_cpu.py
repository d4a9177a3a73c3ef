"""Typos in overrides are refused early, with the closest known name (verl_ds4/recipes/override_keys.py).

Cases (each with its exact message and a negative control that passes the same path):

* ``verl-ds4 recipe sft --dry-run engine.context_paralel_size=2``: Hydra's refusal, then the closest key;
* the same with ``+``: validation FAILS (it said OK before), naming engine.context_parallel_size;
* ``+ds4.memroy_check=warn``: the ds4 tree is checked against its known knobs;
* ``+trainer.my_key=1``: refused, and let through (with a note) by ``+ds4.allow_unknown_keys=[trainer.my_key]``;
* a dict-typed field (``engine.override_transformer_config``) takes any key;
* the CPU launchers compose and check before torchrun / Ray start (a stand-in Python fails the test
  if the trainer is reached), with no third-party warning on the console;
* ``MODEL=deepseek`` is refused by each CPU launcher itself, naming the known models.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import pytest

from verl_ds4 import cli
from verl_ds4.recipes.override_keys import added_keys, precheck

REPO = Path(__file__).resolve().parents[1]


def _recipe(capsys, *overrides: str) -> tuple[int, str, str]:
    rc = cli.main(["recipe", "sft", "--dry-run", *overrides])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_hydra_refusal_is_followed_by_the_closest_key(capsys):
    rc, _, err = _recipe(capsys, "engine.context_paralel_size=2")
    assert rc == 1
    first = err.index("Could not override 'engine.context_paralel_size'")
    hint = err.index(
        "verl-ds4 recipe sft: engine.context_paralel_size is not a setting verl or verl-ds4 reads: did you mean "
        "engine.context_parallel_size=2? (With '+' Hydra would add it, and verl would stop when it builds "
        "DS4McoreEngineConfig from engine.)"
    )
    assert first < hint  # Hydra's own error first


def test_added_typo_is_refused_and_the_spelled_key_passes(capsys):
    rc, out, err = _recipe(capsys, "+engine.context_paralel_size=2")
    assert rc == 1
    assert (
        "ERROR   : +engine.context_paralel_size=2: adds engine.context_paralel_size, which nothing reads: engine "
        "(DS4McoreEngineConfig) has no setting 'context_paralel_size', and verl would stop when it builds "
        "DS4McoreEngineConfig from engine. Fix: did you mean engine.context_parallel_size? Set "
        "engine.context_parallel_size=2 (no '+': the key exists). A new setting there needs a subclass of "
        "DS4McoreEngineConfig with that field, named by engine._target_."
    ) in out
    assert "validation: FAILED (1 errors" in out
    # negative control: the key spelled right composes and validates
    rc, out, _ = _recipe(capsys, "engine.context_parallel_size=2")
    assert rc == 0 and "validation: OK" in out and "nothing reads" not in out


def test_ds4_tree_is_checked(capsys):
    rc, out, _ = _recipe(capsys, "+ds4.memroy_check=warn")
    assert rc == 1
    assert (
        "ERROR   : +ds4.memroy_check=warn: adds ds4.memroy_check, which nothing reads: ds4 (the recipe's ds4 block) "
        "has no setting 'memroy_check'. Fix: did you mean ds4.memory_check? Set ds4.memory_check=warn (no '+': the "
        "key exists). If your own code reads it, say so: +ds4.allow_unknown_keys=[ds4.memroy_check]."
    ) in out
    rc, out, _ = _recipe(capsys, "ds4.memory_check=warn")  # negative control
    assert rc == 0 and "nothing reads" not in out


def test_plain_node_key_needs_the_explicit_allow_list(capsys):
    rc, out, _ = _recipe(capsys, "+trainer.my_key=1")
    assert rc == 1
    assert ("ERROR   : +trainer.my_key=1: adds trainer.my_key, which nothing reads: trainer has no setting 'my_key'. "
            "Fix: check the spelling: trainer has no setting close to 'my_key'. If your own code reads it, say so: "
            "+ds4.allow_unknown_keys=[trainer.my_key].") in out
    rc, out, _ = _recipe(capsys, "+trainer.my_key=1", "+ds4.allow_unknown_keys=[trainer.my_key]")
    assert rc == 0, out
    assert ("note    : trainer.my_key is not a setting verl or verl-ds4 reads; added on purpose "
            "(ds4.allow_unknown_keys lists trainer.my_key).") in out


def test_allow_list_cannot_pass_a_dataclass_key(capsys):
    rc, out, _ = _recipe(capsys, "+engine.my_key=1", "+ds4.allow_unknown_keys=[engine.my_key]")
    assert rc == 1
    assert "verl would stop when it builds DS4McoreEngineConfig from engine (ds4.allow_unknown_keys cannot let it through)." in out


def test_free_form_fields_and_groups_are_not_keys():
    # a dict-typed dataclass field takes any key; an empty YAML mapping too
    status, lines = precheck("sft_trainer_engine", ["engine=megatron", "optim=megatron",
                                                    "+engine.override_transformer_config.cp_partition_mode=zigzag",
                                                    "+optim.override_optimizer_config.optimizer_cpu_offload=true"])
    assert status == 0, lines
    status, lines = precheck("sft_trainer_engine", ["engine=megatron", "optim=megatron", "+engine.cp_partition_mode=x"])
    assert status == 2 and "engine (McoreEngineConfig) has no setting 'cp_partition_mode'" in "\n".join(lines)
    # environment variables for Ray's workers (the production engine's launcher adds them): names of the user's choosing
    status, lines = precheck("ppo_trainer", ["+ray_kwargs.ray_init.runtime_env.env_vars.VERL_ENGINE_VENDOR=production"])
    assert status == 0, lines
    status, lines = precheck("ppo_trainer", ["+ray_kwargs.ray_init.runtime_envv.env_vars.X=1"])  # the control: a typo above
    assert status == 2 and "runtime_envv" in "\n".join(lines), lines
    keys = [a.key for a in added_keys(["+recipe=deepseek_v4_sft", "+ds4_mesh=h200_64gpu_pp4_ep8", "+a.b=1",
                                       "++c=2", "hydra.run.dir=x", "+hydra.job.name=y", "d.e=3"])]
    assert keys == ["a.b", "c"]


def _defaulted_ds4_reads(sources: dict[str, str]) -> dict[str, list[str]]:
    """``ds4`` knob -> where it is read as ``_get(cfg, "ds4.X", <default>)`` (a read with a default: a config may
    leave the knob out, so ``+ds4.X=...`` must pass the typo check)."""
    import ast

    reads: dict[str, list[str]] = {}
    for name, text in sources.items():
        for node in ast.walk(ast.parse(text, name)):
            if not isinstance(node, ast.Call):
                continue
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            has_default = len(node.args) >= 3 or any(k.arg == "default" for k in node.keywords)
            if func != "_get" or len(node.args) < 2 or not has_default:
                continue
            key = node.args[1]
            if isinstance(key, ast.Constant) and isinstance(key.value, str) and key.value.startswith("ds4."):
                reads.setdefault(key.value.split(".")[1], []).append(f"{name}:{node.lineno}")
    return reads


def _missing_from(known: Sequence[str], reads: dict[str, list[str]]) -> dict[str, list[str]]:
    return {k: where for k, where in reads.items() if k not in known}


def test_every_ds4_knob_read_with_a_default_is_a_known_key():
    from verl_ds4.recipes.override_keys import DS4_DEFAULTED_KEYS

    sources = {str(f.relative_to(REPO)): f.read_text() for f in sorted((REPO / "verl_ds4").rglob("*.py"))}
    reads = _defaulted_ds4_reads(sources)
    # What the collector must find (a collector that finds nothing would pass vacuously).
    assert {"memory_check", "memory_headroom", "check_paths", "recipe"} <= set(reads), reads
    missing = _missing_from(DS4_DEFAULTED_KEYS, reads)
    assert not missing, (f"ds4 knobs read with a default but missing from override_keys.DS4_DEFAULTED_KEYS "
                         f"(+ds4.<knob>=... would be refused as a typo): {missing}")
    # Negative controls: the tuple before ds4.memory_headroom and ds4.recipe were added is caught, and so is a
    # new read (positional or keyword default); a read without a default is not one.
    assert set(_missing_from(("memory_check", "check_paths", "allow_unknown_keys"), reads)) == {"memory_headroom",
                                                                                                 "recipe"}
    extra = _defaulted_ds4_reads({"x.py": 'a = _get(cfg, "ds4.new_knob", 1)\nb = roles._get(cfg, "ds4.other", default=2)\n'
                                          'c = _get(cfg, "ds4.model")\n'})
    assert _missing_from(DS4_DEFAULTED_KEYS, extra) == {"new_knob": ["x.py:1"], "other": ["x.py:2"]}


def test_a_defaulted_ds4_knob_may_be_added_where_the_config_leaves_it_out():
    from omegaconf import OmegaConf

    from verl_ds4.recipes.override_keys import check_added_keys

    base = OmegaConf.create({"ds4": {"model": {"name": "x"}}})  # a hand-written config's ds4 block
    for knob in ("memory_headroom", "recipe"):
        full = OmegaConf.merge(base, {"ds4": {knob: "v"}})
        problems, _ = check_added_keys(base, full, [f"+ds4.{knob}=v"], group_roots=[])
        assert not problems, problems
    # Negative control: a misspelt one is refused, naming the knob.
    full = OmegaConf.merge(base, {"ds4": {"memory_headrom": 0.2}})
    problems, _ = check_added_keys(base, full, ["+ds4.memory_headrom=0.2"], group_roots=[])
    assert len(problems) == 1 and "did you mean ds4.memory_headroom?" in str(problems[0]), problems


def test_precheck_leaves_logging_as_it_found_it():
    import logging

    before = logging.root.manager.disable
    try:
        for level in (logging.NOTSET, logging.INFO):
            logging.disable(level)
            status, _ = precheck("sft_trainer_engine", ["engine=megatron", "optim=megatron", "+engine.cp_mode=x"])
            assert status == 2
            assert logging.root.manager.disable == level, "precheck left logging disabled"
            status, _ = precheck("sft_trainer_engine", ["no_such_group=x"])  # the Hydra-error return path
            assert status == 2 and logging.root.manager.disable == level
        # Negative control: the check above sees logging left disabled.
        logging.disable(logging.CRITICAL)
        assert logging.root.manager.disable != logging.NOTSET
    finally:
        logging.disable(before)


# ------------------------------------------------------------------------------------ the launchers


def _stand_in_python(tmp_path: Path) -> Path:
    """A Python that runs the launcher's checks for real; the trainer (and the assets it would read) it stands in for."""
    shim = tmp_path / "python"
    shim.write_text(
        "#!/usr/bin/env bash\n"
        'case "$1 $2" in *demo_task.py*|"-m verl_ds4.cpu.sft_data") exit 0;; esac\n'
        'for a in "$@"; do case "$a" in torch.distributed.run|verl.trainer.main_ppo|verl_ds4.cpu.console)\n'
        '  echo "TRAINER REACHED"; exit 0;; esac; done\n'
        f'exec {sys.executable} "$@"\n'
    )
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    return shim


def _launch(script: str, tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    full_env = {**os.environ, "WORK_DIR": str(tmp_path / "run"), **env}
    full_env["PYTHON"] = str(_stand_in_python(tmp_path))
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    start = time.monotonic()
    out = subprocess.run(["bash", str(REPO / "scripts" / script), *args], env=full_env, capture_output=True,
                         text=True, timeout=300)
    return out, time.monotonic() - start


@pytest.mark.parametrize("script", ["run_ds4_proxy_sft_cpu.sh", "run_ds4_proxy_ppo_cpu.sh"])
def test_cpu_launcher_refuses_a_typo_before_the_trainer(tmp_path, script):
    out, _ = _launch(script, tmp_path, "engine.context_paralel_size=2" if "sft" in script
                     else "actor_rollout_ref.actor.megatron.context_paralel_size=2")
    before = "torchrun started" if "sft" in script else "Ray started"
    config = "sft_trainer_engine" if "sft" in script else "ppo_trainer"
    assert out.returncode == 2, out.stdout + out.stderr
    assert "TRAINER REACHED" not in out.stdout
    lines = out.stderr.splitlines()
    assert lines[0] == (f"[verl-ds4] FAILED: the overrides do not compose with verl's {config} config (Hydra's "
                        f"error; checked before {before}):")
    assert "Could not override" in lines[1]
    assert "did you mean" in out.stderr and "context_parallel_size=2?" in out.stderr
    for noise in ("Apex", "TransformerEngine", "Warning", "WARNING"):
        assert noise not in out.stderr


def test_cpu_sft_launcher_refuses_an_added_typo_and_passes_the_right_key(tmp_path):
    out, _ = _launch("run_ds4_proxy_sft_cpu.sh", tmp_path, "+engine.context_paralel_size=2")
    assert out.returncode == 2 and "TRAINER REACHED" not in out.stdout
    assert out.stderr.splitlines()[0] == ("[verl-ds4] FAILED: 1 override(s) add a key that nothing reads (checked "
                                          "before torchrun started):")
    assert ("[verl-ds4]   +engine.context_paralel_size=2: adds engine.context_paralel_size, which nothing reads: "
            "engine (CPUMcoreEngineConfig) has no setting 'context_paralel_size'") in out.stderr
    for noise in ("Apex", "TransformerEngine", "Warning", "WARNING", "Platform"):
        assert noise not in out.stderr
    # negative control: the same launcher with the key spelled right reaches the trainer
    out, _ = _launch("run_ds4_proxy_sft_cpu.sh", tmp_path, "engine.context_parallel_size=2")
    assert out.returncode == 0 and "TRAINER REACHED" in out.stdout, out.stderr


@pytest.mark.parametrize("script, known", [
    ("run_ds4_proxy_sft_cpu.sh", "ds4 (the full tiny DS4, default), ds4_proxy (attention-only), tiny_dense or ds41 "
                                 "(DeepSeek-V4.1)"),
    ("run_ds4_proxy_ppo_cpu.sh", "ds4 (the full tiny DS4, default), ds4_proxy (attention-only) or ds41 (DeepSeek-V4.1)"),
])
def test_cpu_launcher_checks_model_itself(tmp_path, script, known):
    out, _ = _launch(script, tmp_path, MODEL="deepseek")
    assert out.returncode == 2
    assert out.stderr.strip() == f"MODEL=deepseek: expected one of the known models {known}, e.g. MODEL=ds4"
    assert "usage:" not in out.stderr and "invalid choice" not in out.stderr
