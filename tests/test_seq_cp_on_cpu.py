"""``ds4.max_seq_len`` derives the CP (verl_ds4/recipes/seq_cp.py): the mesh's CP when it holds the length at peak,
else the smallest CP size of the mesh that does; a CP the user set is kept and refused, naming the sizes that would,
when it cannot; a length no size holds is refused with each size's peak; ``--dry-run --json`` carries it all.
Each with a negative control. Seconds on CPU (Hydra compositions and the start-up check, no model)."""

from __future__ import annotations

import argparse
import io
import json
from contextlib import redirect_stdout

from verl_ds4.recipes import seq_cp
from verl_ds4.recipes.compose import compose_recipe, derivation
from verl_ds4.recipes.validate import validate_recipe


def test_allowed_cps_are_the_powers_of_two_dividing_gpus_over_tp_pp():
    assert seq_cp.allowed_cps(64, 1, 8) == (1, 2, 4, 8)
    assert seq_cp.allowed_cps(64, 1, 4) == (1, 2, 4, 8, 16)
    assert seq_cp.allowed_cps(40, 1, 5) == (1, 2, 4, 8)
    assert seq_cp.allowed_cps(24, 1, 3) == (1, 2, 4, 8)
    assert seq_cp.allowed_cps(64, 1, 3) == ()  # PP does not divide the GPUs


#: 64 sequences at once per rollout engine: the KV cache of 128 at 64k tokens (verl's max_num_seqs 256, 1,024 sequences
#: over 8 engines) does not fit beside the bf16 rollout weights on H200 (tests/test_memory_rollout_kv_on_cpu.py).
KV = "actor_rollout_ref.rollout.max_num_seqs=64"


def test_a_length_the_mesh_cp_cannot_hold_derives_a_larger_cp():
    d = derivation("grpo", ["ds4.max_seq_len=65536", KV])  # default mesh h200_64gpu_pp8_ep8_cp2
    assert (d.mesh_cp, d.cp, d.derived_cp, d.explicit) == (2, 8, True, None)
    assert d.overrides[0] == "ds4.mesh.cp=8" and d.peaks[2] > d.limit_gib >= d.peaks[8]
    assert d.peaks[4] > d.limit_gib  # the smallest size that holds it is chosen, not just any larger one
    cfg = compose_recipe("grpo", ["ds4.max_seq_len=65536", KV])
    assert cfg.actor_rollout_ref.actor.megatron.context_parallel_size == 8 == cfg.actor_rollout_ref.ref.megatron.context_parallel_size
    report = validate_recipe(cfg, "ppo", dry_run=True, raise_on_error=False)
    assert not report.errors, [str(e) for e in report.errors]
    assert "derived (the mesh's CP 2 does not hold it)" in d.describe()
    # negative control: the mesh's CP 2 at that length is refused by the memory check
    kept = validate_recipe(compose_recipe("grpo", ["ds4.max_seq_len=65536", "ds4.mesh.cp=2", KV]), "ppo", dry_run=True, raise_on_error=False)
    assert any(e.setting == "actor memory" for e in kept.errors)


def test_a_length_the_mesh_cp_holds_keeps_it():
    d = derivation("grpo", ["ds4.max_seq_len=8192"])
    assert (d.cp, d.derived_cp) == (2, False) and not any(o.startswith("ds4.mesh.cp") for o in d.overrides)
    assert list(d.peaks) == [2]  # judged once: a held length costs one start-up check
    assert compose_recipe("grpo", ["ds4.max_seq_len=8192"]).actor_rollout_ref.actor.megatron.context_parallel_size == 2


def test_an_explicit_cp_is_kept_and_refused_with_the_sizes_that_would():
    d = derivation("grpo", ["ds4.max_seq_len=65536", "ds4.mesh.cp=4"])
    assert (d.cp, d.explicit, d.derived_cp) == (4, "ds4.mesh.cp", False)
    assert not any(o.startswith("ds4.mesh.cp") for o in d.overrides)  # never replaced
    assert len(d.problems) == 1 and d.problems[0].setting == "ds4.mesh.cp"
    text = str(d.problems[0])
    assert "is 4, which cannot hold ds4.max_seq_len=65536 at peak" in text and "set ds4.mesh.cp=8" in text and "[8]" in text
    # an engine's context_parallel_size is the user's CP too
    engine = derivation("grpo", ["ds4.max_seq_len=65536", "actor_rollout_ref.actor.megatron.context_parallel_size=4"])
    assert engine.explicit == "actor_rollout_ref.actor.megatron.context_parallel_size" and engine.problems
    # negative control: an explicit CP that holds it is not refused
    assert not derivation("grpo", ["ds4.max_seq_len=65536", "ds4.mesh.cp=8"]).problems


def test_a_length_no_cp_size_holds_is_refused_with_each_sizes_peak():
    d = derivation("sft", ["ds4.max_seq_len=1048576"])
    assert d.cp == d.mesh_cp == 2 and not d.derived_cp
    assert set(d.peaks) == set(d.allowed) == {1, 2, 4, 8}
    assert len(d.problems) == 1 and d.problems[0].setting == "ds4.max_seq_len"
    assert "no CP size of this mesh ([1, 2, 4, 8]" in str(d.problems[0]) and "CP 8:" in str(d.problems[0])


def test_memory_check_off_derives_no_cp():
    d = derivation("grpo", ["ds4.max_seq_len=65536", "ds4.memory_check=off"])
    assert d.cp == 2 and not d.peaks and not d.problems and not any(o.startswith("ds4.mesh.cp") for o in d.overrides)


def _dry_run_json(kind: str, overrides: list[str]) -> tuple[int, dict]:
    from verl_ds4.recipes.command import run

    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = run(argparse.Namespace(kind=kind, dry_run=True, shell_env=False, json=True, overrides=overrides))
    return rc, json.loads(buf.getvalue())


def test_dry_run_json_carries_the_derived_lengths_and_cp():
    rc, plan = _dry_run_json("grpo", ["ds4.max_seq_len=65536", KV])
    assert rc == 0 and plan["valid"], plan["errors"]
    lengths = plan["lengths"]
    assert lengths["max_seq_len"] == 65536 and lengths["data.max_prompt_length"] == 8192
    assert lengths["actor_rollout_ref.rollout.max_model_len"] == 65536
    derived = lengths["derived"]
    assert derived["cp"] == 8 and derived["cp_derived"] and derived["overrides"][0] == "ds4.mesh.cp=8"
    assert set(derived["peak_gib_per_cp"]) == {"1", "2", "4", "8"} and plan["engines"]["actor"]["cp"] == 8
    rc, refused = _dry_run_json("grpo", ["ds4.max_seq_len=65536", "ds4.mesh.cp=4"])
    assert rc == 1 and any(e.startswith("ds4.mesh.cp: is 4") for e in refused["errors"])
    # negative control: without the knob nothing is derived
    rc, plain = _dry_run_json("sft", [])
    assert plain["lengths"]["derived"] is None and plain["lengths"]["data.max_length"] == 4096
