"""The memory model and the start-up memory check (verl_ds4/memory/).

* The model reproduces the figures worked out by hand from the meta-device parameter counts for the
  combinations the real-sizes issue lists (states per GPU, rollout weights per GPU).
* Megatron's storage rules: dense optimizer states shard over DP x CP, routed experts' over
  expert-DP; the precision-aware optimizer and Megatron's CPU optimizer offload lower the figure by
  exactly what they store less on the GPU.
* DeepSeek-V4.1 (``v41_flash``): the Engram tables shard like the routed experts (over EP, their
  optimizer state over expert-DP), and its recipes (deepseek_v41_sft / deepseek_v41_grpo) x meshes
  pass the check.
* Every shipped recipe x mesh pair, for each model the mesh names, passes the check, except the
  pairs the mesh marks as needing Megatron's CPU optimizer offload: those are refused as shipped
  and pass with the fraction the mesh states, which is the smallest the check suggests.
* A refusal names the role, the stage, the figure, the capacity and fixes; applying a suggested
  fix makes it pass. ``ds4.memory_check=warn|off`` go on and say so; an unknown hardware is
  refused unless ``ds4.mesh.gpu_memory_gib`` is set.
"""

from __future__ import annotations

import re
from importlib.resources import files

import pytest
import yaml

from verl_ds4.models.ds4.sizes import DS4Sizes
from verl_ds4.models.ds41.sizes import DS41Sizes
from verl_ds4.recipes.compose import compose_recipe
from verl_ds4.memory.stages import (
    GPU_MEMORY_GIB, Mesh, OptimizerSettings, gpu_memory_gib, rollout_weights_gib, training_memory, worst_stage,
)
from verl_ds4.recipes.validate import RecipeValidationError, validate_recipe

TRAINER = {"sft": "sft", "ppo": "ppo", "grpo": "ppo", "deepseek_v41_sft": "sft", "deepseek_v41_grpo": "ppo"}
RECIPES = ("sft", "ppo", "grpo")
#: The recipes of each model family (a mesh's ``models`` entry decides which ones it is checked with).
MODEL_RECIPES = {"v41_flash": ("deepseek_v41_sft", "deepseek_v41_grpo")}


def sizes(model: str) -> DS4Sizes:
    block = yaml.safe_load((files("verl_ds4.configs_data") / "ds4_model" / f"{model}.yaml").read_text())
    return (DS41Sizes if model.startswith("v41") else DS4Sizes).from_hf_config({}, model, fallback=block)


def meshes() -> dict[str, dict]:
    folder = files("verl_ds4.configs_data") / "ds4_mesh"
    return {p.name[:-5]: yaml.safe_load(p.read_text()) for p in folder.iterdir() if p.name.endswith(".yaml")}


def validate(kind: str, overrides: list[str], **kw):
    cfg = compose_recipe(kind, overrides)
    return cfg, validate_recipe(cfg, TRAINER[kind], dry_run=True, **kw)


def static(model, world, pp, ep, cp=1, mtp=False, **optim):
    return worst_stage(training_memory(sizes(model), Mesh(world, pp, ep, cp), OptimizerSettings(**optim), mtp=mtp)).static_gib


# ---------------------------------------------------------------- figures


@pytest.mark.parametrize(
    "model, world, pp, ep, cp, mtp, expected",
    [
        ("flash", 32, 4, 8, 1, True, 163.5),  # SFT default as shipped before (h100_32gpu_pp4_ep8)
        ("flash", 64, 4, 8, 4, True, 112.5),  # SFT h200_64gpu_pp4_ep8_cp4
        ("flash", 64, 8, 8, 1, False, 90.6),  # PPO/GRPO h200_64gpu_pp8_ep8_cp2
        ("pro", 32, 4, 8, 1, False, 900.3),  # Pro on gb300_32gpu_pp4_ep8
        ("pro", 256, 4, 64, 1, False, 147.4),  # Pro GRPO on gb300_256gpu_pp4_ep64
        ("v41_flash", 192, 4, 48, 4, False, 96.3),  # V4.1 SFT as shipped before (h200_192gpu_pp4_ep48_cp4)
        ("v41_flash", 96, 4, 24, 4, False, 178.7),  # V4.1 GRPO as shipped before (gb300_96gpu_pp4_ep24_cp4)
        ("v41_flash", 384, 1, 192, 2, False, 89.7),  # V4.1 SFT h200_384gpu_pp1_ep192_cp2 (expert-DP 2)
        ("v41_flash", 128, 1, 128, 2, False, 144.0),  # V4.1 GRPO gb300_128gpu_pp1_ep128_cp2
        ("v41_flash", 64, 2, 32, 8, False, 271.0),  # Megatron's V4.1 mesh (#7285), tables trained: 8 GiB left
    ],
)
def test_states_per_gpu_of_the_listed_combinations(model, world, pp, ep, cp, mtp, expected):
    assert static(model, world, pp, ep, cp, mtp) == pytest.approx(expected, abs=0.05)


@pytest.mark.parametrize("model, tp, expected", [("flash", 8, 66.2), ("flash", 4, 132.4), ("pro", 4, 732.5)])
def test_rollout_weights_per_gpu(model, tp, expected):
    assert rollout_weights_gib(sizes(model), tp) == pytest.approx(expected, abs=0.05)
    assert rollout_weights_gib(sizes(model), tp, "fp8") == pytest.approx(expected / 2, abs=0.05)


def test_optimizer_sharding_follows_megatron_groups():
    s = sizes("flash")
    # stage 1 of PP4 (layers 11..21, no embedding, no head): everything is layer parameters
    one = training_memory(s, Mesh(64, 4, 8, 1))[1]
    ratios = s.compress_ratios[11:22]
    routed = sum(s.layer(r)["moe_routed"] for r in ratios)
    dense = sum(sum(s.layer(r).values()) for r in ratios) - routed
    gib = float(1 << 30)
    assert one.weights_gib == pytest.approx(2 * (dense + routed / 8) / gib)
    assert one.grads_gib == pytest.approx(4 * (dense + routed / 8) / gib)
    # dense over DP x CP = 64/4 = 16, experts over expert-DP = 64/(8*4) = 2
    assert one.optimizer_gib == pytest.approx(12 * (dense / 16 + routed / 8 / 2) / gib)
    # CP does not change expert-DP, only the dense ranks: CP4 keeps DPxCP 16 here
    assert training_memory(s, Mesh(64, 4, 8, 4))[1].optimizer_gib == pytest.approx(one.optimizer_gib)
    # without the distributed optimizer nothing is sharded (negative control of the sharding)
    full = training_memory(s, Mesh(64, 4, 8, 1), OptimizerSettings(distributed=False))[1]
    assert full.optimizer_gib == pytest.approx(12 * (dense + routed / 8) / gib)


def test_v41_engram_tables_shard_like_the_routed_experts():
    s = sizes("v41_flash")
    stage = training_memory(s, Mesh(192, 4, 48, 4))[0]  # layers 0..9: the embedding and layer 1's table
    parts = [s.layer_params(i) for i in range(10)]
    routed = sum(p["moe_routed"] for p in parts)
    table = sum(p["engram_table"] for p in parts)
    dense = sum(sum(p.values()) for p in parts) - routed - table + s.embedding()
    assert table == 384_006_168 * 256 and sum(p["engram"] for p in parts) > 0  # layer 1 only; layer 14 is stage 1's
    gib = float(1 << 30)
    local = dense + (routed + table) / 48
    assert stage.weights_gib == pytest.approx(2 * local / gib) and stage.grads_gib == pytest.approx(4 * local / gib)
    # dense over DP x CP = 192/4 = 48, experts and tables over expert-DP = 192/(48*4) = 1
    assert stage.optimizer_gib == pytest.approx(12 * (dense / 48 + (routed + table) / 48) / gib)
    # negative control: a table kept whole on every GPU (not split over EP) would not fit an H200 at all
    class WholeTables(DS41Sizes):
        expert_sharded = ("moe_routed",)

    whole = WholeTables(**{f: getattr(s, f) for f in s.__dataclass_fields__})
    assert worst_stage(training_memory(whole, Mesh(192, 4, 48, 4))).static_gib > 4 * GPU_MEMORY_GIB["H200"]
    # the DSpark drafter is not trained: MTP on adds nothing (V4.1 has no MTP layer)
    assert training_memory(s, Mesh(192, 4, 48, 4), mtp=True) == training_memory(s, Mesh(192, 4, 48, 4))


def test_precision_aware_optimizer_and_cpu_offload():
    base = training_memory(sizes("flash"), Mesh(32, 4, 8))[1]
    aware = training_memory(sizes("flash"), Mesh(32, 4, 8), OptimizerSettings(main_params_bytes=2, exp_avg_bytes=2, exp_avg_sq_bytes=2))[1]
    assert aware.optimizer_gib == pytest.approx(base.optimizer_gib / 2)  # 6 bytes instead of 12
    half = training_memory(sizes("flash"), Mesh(32, 4, 8), OptimizerSettings(cpu_offload_fraction=0.5))[1]
    assert half.optimizer_gib == pytest.approx(base.optimizer_gib / 2)
    assert half.host_gib == pytest.approx(base.optimizer_gib / 2 * 16 / 12)  # the states and an fp32 grad copy
    assert half.weights_gib == base.weights_gib and half.grads_gib == base.grads_gib


def test_gpu_capacity_by_hardware_and_explicit_value():
    assert gpu_memory_gib("H200") == GPU_MEMORY_GIB["H200"] and gpu_memory_gib("H200", 141) == 141.0
    with pytest.raises(ValueError, match=r"known: \['B200', 'GB200', 'GB300', 'H100-80GB', 'H200'\]"):
        gpu_memory_gib("A100")
    assert gpu_memory_gib("A100", 80) == 80.0


# ---------------------------------------------------------------- shipped recipes x meshes


def _not_for(mesh: dict, model: str, kind: str) -> str | None:
    labels = mesh.get("not_for") or {}
    return labels.get(f"{model}:{kind}") or labels.get(kind)


def _pairs(accepted_only: bool = False):
    for mesh_name, mesh in sorted(meshes().items()):
        for model in mesh["models"]:
            for kind in MODEL_RECIPES.get(model, RECIPES):
                if not (accepted_only and _not_for(mesh, model, kind)):
                    yield kind, mesh_name, model


@pytest.mark.parametrize("kind, mesh_name, model", list(_pairs()))
def test_every_shipped_recipe_and_mesh_fits_at_peak_or_is_a_labelled_refusal(kind, mesh_name, model):
    """Accepted implies every role's peak (every pass, every stage) <= GPU x (1 - headroom); a pair the mesh labels
    ``not_for`` is refused as shipped, for the reason the label gives (peak, states or host RAM)."""
    mesh = meshes()[mesh_name]
    assert mesh["hardware"] in GPU_MEMORY_GIB and mesh_name.startswith(mesh["hardware"].split("-")[0].lower())
    assert mesh["name"] == mesh_name
    overrides = [f"ds4_mesh={mesh_name}", f"ds4_model={model}"]
    label = _not_for(mesh, model, kind)
    if label is None:
        _, report = validate(kind, overrides)
        memory = report.memory
        assert report.errors == [] and memory.headroom == 0.1
        for rm in memory.roles:
            for stages in rm.passes.values():
                assert all(s.peak_gib <= memory.limit_gib for s in stages), (rm.role, [s.peak_gib for s in stages])
        return
    with pytest.raises(RecipeValidationError) as info:
        validate(kind, overrides)
    reason = label.split(":")[0]
    assert reason in ("peak", "states", "host RAM")
    text = str(info.value)
    if reason == "host RAM":
        assert "host memory: a node needs" in text, text
    else:  # a training role's peak is refused; "states": its states alone exceed the limit, "peak": only the peak does
        assert re.search(r"\b(sft|actor|critic|ref) memory: ", text), text
        assert ("(the states alone exceed it)" in text) == (reason == "states"), text


def test_a_larger_budget_on_an_accepted_mesh_is_refused():
    """Negative control of the test above: the check can fail a shipped mesh (the H200 default at 16384 tokens per GPU
    with the linear core, and at 8192 with Megatron's)."""
    _, report = validate("sft", [])
    assert report.errors == [] and report.memory.roles[0].tokens_per_gpu == 8192
    with pytest.raises(RecipeValidationError, match=r"sft memory: .*linear attention.*16384 tokens per GPU.*exceeds 125\.8 GiB"):
        validate("sft", ["ds4.max_token_len_per_gpu=16384"])
    with pytest.raises(RecipeValidationError, match=r"sft memory: .*unfused attention.*8192 tokens per GPU.*exceeds 125\.8 GiB"):
        validate("sft", ["ds4.sparse_attention=megatron"])


def test_launcher_defaults_and_suggestions_are_shipped_pairs():
    """The launchers' default meshes and the Pro suggestion in their comments are pairs the test above accepts."""
    from pathlib import Path

    scripts = Path(__file__).resolve().parents[1] / "scripts"
    for kind in RECIPES:
        kinds = {kind, f"deepseek_v41_{kind}"} | ({"deepseek_v41_grpo"} if kind == "ppo" else set())  # no V4.1 PPO recipe
        shipped = {(m, model) for k, m, model in _pairs(accepted_only=True) if k in kinds}
        text = (scripts / f"run_deepseek_v4_flash_{kind}_megatron.sh").read_text()
        v41 = re.search(r"\n +v41(?::grpo)?\)\n(.*?);;", text, re.S)  # MODEL_VERSION=v41's defaults
        if v41:
            assert (re.search(r"MESH=\$\{MESH:-(\w+)\}", v41.group(1)).group(1), "v41_flash") in shipped
            text = text.replace(v41.group(0), "")
        default = re.search(r"MESH=\$\{MESH:-(\w+)\}", text)
        if default:
            assert (default.group(1), "flash") in shipped
        for mesh in re.findall(r"ds4_model=pro ds4_mesh=(\w+)", text):
            assert (mesh, "pro") in shipped


# ---------------------------------------------------------------- refusals and modes


def test_refusal_names_role_pass_stage_terms_capacity_and_the_smallest_lever_that_works():
    megatron = "ds4.sparse_attention=megatron"  # Megatron's own unfused core: the mesh's 4096 tokens do not fit at CP 1
    with pytest.raises(RecipeValidationError) as info:
        validate("sft", ["ds4_mesh=h200_64gpu_pp4_ep8", megatron])
    text = str(info.value)
    assert ("sft memory: sft (TP1/PP4/EP8/CP1, DP x CP 16, expert-DP 2; unfused attention, recompute full, 4096 tokens "
            "per GPU) update pass, stage 0 (11 layers): peak 155.0 GiB per GPU = states 112.3") in text
    assert "exceeds 125.8 GiB, the 139.8 GiB of one H200 less the headroom 0.1 (ds4.memory_headroom)" in text
    lever = re.search(r"fewer tokens per GPU: ds4\.max_token_len_per_gpu=(\d+) with ds4\.mesh\.cp=(\d+)", text)
    assert lever and lever.groups() == ("1024", "4")
    _, report = validate("sft", ["ds4_mesh=h200_64gpu_pp4_ep8", megatron, "ds4.max_token_len_per_gpu=1024", "ds4.mesh.cp=4"])
    assert report.errors == []
    # the next budget up does not fit: the suggestion is the largest budget that does
    with pytest.raises(RecipeValidationError):
        validate("sft", ["ds4_mesh=h200_64gpu_pp4_ep8", megatron, "ds4.max_token_len_per_gpu=2048", "ds4.mesh.cp=2"])
    # every lever listed lowers the peak under the limit; the linear core and the fused kernel (SM90, indexer loss 0)
    assert "the fused attention kernel: ds4.dsa_kernel_backend=cudnn;" in text
    _, report = validate("sft", ["ds4_mesh=h200_64gpu_pp4_ep8", megatron, "ds4.dsa_kernel_backend=cudnn"])
    assert report.errors == []
    assert "the memory-linear sparse attention: ds4.sparse_attention=linear" in text
    _, report = validate("sft", ["ds4_mesh=h200_64gpu_pp4_ep8"])  # the mesh as shipped: the linear core
    assert report.errors == [] and report.memory.roles[0].path == "linear"


def test_states_alone_over_the_gpu_are_said_so():
    with pytest.raises(RecipeValidationError, match=r"sft memory: .*states 163\.\d .*\(the states alone exceed it\)"):
        validate("sft", ["ds4_mesh=h100_32gpu_pp4_ep8"])


def test_rollout_that_does_not_fit_is_refused_with_fp8_or_tp():
    with pytest.raises(RecipeValidationError) as info:
        validate("grpo", ["ds4_mesh=gb200_40gpu_pp5_ep8_cp2", "ds4.rollout.quantization=null"])
    text = str(info.value)
    assert "rollout memory: vllm weights (bf16, TP4) 132.4 GiB per GPU exceed gpu_memory_utilization 0.6 x 184.0 GiB" in text
    assert "ds4.rollout.quantization=fp8" in text


def test_colocated_roles_without_offload_are_refused_together():
    # each role fits alone (101.7 GiB update peak on an H200) but not beside the other's resident states
    with pytest.raises(RecipeValidationError, match=r"actor update: its peak 101\.7 GiB plus 90\.6 GiB"):
        validate("ppo", ["ds4.offload.param=false", "ds4.offload.optimizer=false"])
    _, report = validate("ppo", [])  # the recipe's default offload
    assert report.errors == [] and dict(report.memory.phases)["actor update"] == pytest.approx(101.7, abs=0.05)


def test_warn_and_off_modes_go_on_and_say_so():
    _, report = validate("sft", ["ds4_mesh=h100_32gpu_pp4_ep8", "ds4.memory_check=warn"])
    assert report.errors == [] and any("ds4.memory_check=warn" in w.message for w in report.warnings)
    assert any("the run is NOT refused" in n for n in report.notes)
    _, report = validate("sft", ["ds4_mesh=h100_32gpu_pp4_ep8", "ds4.memory_check=off"])
    assert report.errors == [] and report.memory.skipped.startswith("ds4.memory_check=off")
    with pytest.raises(RecipeValidationError, match="ds4.memory_check: is 'maybe'"):
        validate("sft", ["ds4.memory_check=maybe"])


def test_unknown_hardware_is_refused_unless_its_memory_is_given():
    with pytest.raises(RecipeValidationError, match=r"ds4.mesh.hardware: .*'A100'.*known: \['B200'"):
        validate("sft", ["ds4.mesh.hardware=A100"])
    _, report = validate("sft", ["ds4.mesh.hardware=A100", "ds4.mesh.gpu_memory_gib=200", "ds4.mesh.host_memory_gib=1000"])
    assert report.errors == [] and report.memory.capacity_gib == 200.0
    # the explicit capacity wins over the name, and is what the refusal compares with
    with pytest.raises(RecipeValidationError, match=r"exceeds 90\.0 GiB, the 100\.0 GiB of one H200"):
        validate("sft", ["ds4.mesh.gpu_memory_gib=100"])


def test_plan_prints_the_memory_table(capsys):
    from verl_ds4.recipes.command import add_arguments, run

    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args(["grpo", "--dry-run"])) == 0
    out = capsys.readouterr().out
    assert "memory per GPU (GiB) on H200 (139.8 GiB each, peak limit 125.8 with headroom 0.1; check: error)" in out
    assert re.search(r"actor +update +PP8/EP8/CP2 DPxCP 8 eDP 1 +linear +full +8192 +0 +90\.6 .* fused 1\.1 .* 111\.2 +yes", out)
    assert re.search(r"ref +forward +PP8/EP8/CP2 .* 16384 .* fused 0\.0 ", out)
    assert ("rollout: TP8 bf16 weights 66.2 + KV cache 3.2 (128 sequences of 3,072 tokens per engine) GiB per GPU of a "
            "0.6 x 139.8 = 83.9 GiB share: fits") in out


# ---------------------------------------------------------------- verl-ds4 plan --fit


def plan_fit(*args: str) -> tuple[int, dict | str]:
    import contextlib
    import io
    import json

    from verl_ds4.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["plan", "--fit", *args])
    text = out.getvalue()
    return rc, (json.loads(text) if "--json" in args else text)


def _meshes(result: dict) -> set[tuple[int, int, int]]:
    return {(m["gpus"], m["pp"], m["ep"]) for m in result["meshes"]}


def test_plan_fit_judges_the_peak_and_names_the_levers():
    """Flash on 64 H200 (unfused, full recompute, 4096 tokens): no mesh fits at peak; the closest rows list levers,
    each of which, applied, makes that mesh fit. --states-only keeps the old rule (Bridge's PP4/EP8 fits on states)."""
    rc, flash = plan_fit("--model", "flash", "--gpu", "H200", "--gpus", "64", "--json")
    assert rc == 1 and flash["meshes"] == [] and flash["judged_on"] == "peak"
    closest = flash["not_fitting"][0]
    assert (closest["pp"], closest["ep"]) == (4, 16) and closest["peak_gib"] > closest["limit_gib"] == 125.82
    assert any(lever.startswith("fewer tokens per GPU: ds4.max_token_len_per_gpu=2048 with ds4.mesh.cp=2") for lever in closest["levers"])
    rc, fixed = plan_fit("--model", "flash", "--gpu", "H200", "--gpus", "64", "--tokens-per-gpu", "2048", "--max-seq-len", "4096", "--json")
    assert rc == 0 and (64, 4, 16) in _meshes(fixed) and all(m["peak_gib"] <= m["limit_gib"] for m in fixed["meshes"])
    assert all(m["cp"][0] == 2 for m in fixed["meshes"])  # 2048 tokens x CP 2 hold the 4096-token sequence
    rc, fused = plan_fit("--model", "flash", "--gpu", "H200", "--gpus", "64", "--kernel", "fused", "--json")
    assert rc == 0 and (64, 4, 16) in _meshes(fused)
    rc, states = plan_fit("--model", "flash", "--gpu", "H200", "--gpus", "64", "--states-only", "--json")
    assert rc == 0 and (64, 4, 8) in _meshes(states)  # Megatron-Bridge's Flash SFT mesh: its states fit


def test_plan_fit_on_blackwell_and_for_pro():
    # Flash SFT on 32 GB200 (fused by default on SM100): nothing fits at peak; more GPUs or optimizer offload do
    rc, text = plan_fit("--model", "flash", "--gpu", "GB200", "--gpus", "32", "--max", "2")
    assert rc == 1 and "fused attention, recompute full, 4096 tokens per GPU" in text
    assert "no TP=1 mesh fits on 32 GPUs" in text and "more GPUs: ds4.mesh.nnodes=16" in text
    # Pro on 256 GB300: Megatron-Bridge's PP4/EP64 fits SFT and GRPO at peak, with each role's peak shown
    for recipe in ("sft", "grpo"):
        rc, pro = plan_fit("--model", "pro", "--gpu", "GB300", "--gpus", "256", "--recipe", recipe, "--json")
        assert rc == 0 and (256, 4, 64) in _meshes(pro)
    row = next(m for m in pro["meshes"] if (m["pp"], m["ep"]) == (4, 64))
    assert set(row["roles"]) == {"actor", "ref"} and row["roles"]["actor"]["peak_gib"] > row["roles"]["actor"]["states_gib"]


def test_plan_fit_for_v41_flash():
    rc, text = plan_fit("--model", "v41_flash", "--gpu", "H200", "--gpus", "384", "--tokens-per-gpu", "2048",
                        "--max-seq-len", "4096", "--max", "2")
    assert rc == 0 and text.splitlines()[0].startswith(
        "DeepSeek-V4.1-Flash: 748.49B parameters incl. 196.61B Engram tables (16.13B activated), MTP off; H200")
    h200 = _meshes(plan_fit("--model", "v41_flash", "--gpu", "H200", "--gpus", "384", "--tokens-per-gpu", "2048",
                            "--max-seq-len", "4096", "--json")[1])
    assert (384, 1, 192) in h200  # the shipped V4.1 H200 mesh (PP 1: Megatron-Bridge's V4.1 provider)
    gb300 = _meshes(plan_fit("--model", "v41_flash", "--gpu", "GB300", "--gpus", "128", "--recipe", "grpo",
                             "--tokens-per-gpu", "2048", "--max-seq-len", "4096", "--json")[1])
    assert (128, 1, 128) in gb300


def test_plan_fit_leaves_out_the_combinations_that_do_not_fit():
    rc, text = plan_fit("--model", "flash", "--gpu", "H100-80GB", "--gpus", "32")
    assert rc == 1 and "no TP=1 mesh fits on 32 GPUs" in text  # Bridge's 32gpu_h100 shape
    rc, pro32 = plan_fit("--model", "pro", "--gpu", "GB300", "--gpus", "32", "--recipe", "grpo", "--json")
    assert rc == 1 and pro32["meshes"] == []
    # the stated headroom decides: PP4/EP16 on 64 H200 fits at 2048 tokens with 0.1, not with 0.3
    args = ("--model", "flash", "--gpu", "H200", "--gpus", "64", "--tokens-per-gpu", "2048", "--max-seq-len", "4096")
    assert (64, 4, 16) not in _meshes(plan_fit(*args, "--headroom", "0.3", "--json")[1])


def test_plan_fit_table_json_and_a_config_folder(tmp_path):
    import json

    rc, text = plan_fit("--model", "flash", "--gpu", "H200", "--gpus", "32-128", "--tokens-per-gpu", "2048",
                        "--max-seq-len", "4096", "--max", "3")
    assert rc == 0 and text.splitlines()[0].startswith("DeepSeek-V4-Flash: 284.33B parameters (13.27B activated), MTP on; H200")
    rows = [line.split() for line in text.splitlines()[3:6]]
    assert [int(r[0]) for r in rows] == sorted(int(r[0]) for r in rows) and int(rows[0][0]) == 64  # fewest GPUs first
    peaks = [float(r[7]) for r in rows if int(r[0]) == 64]
    assert peaks == sorted(peaks)  # then the lowest peak
    block = yaml.safe_load((files("verl_ds4.configs_data") / "ds4_model" / "pro.yaml").read_text())
    config = {k: block[k] for k in ("vocab_size", "hidden_size", "num_attention_heads", "head_dim", "q_lora_rank",
                                    "o_groups", "o_lora_rank", "n_routed_experts", "n_shared_experts",
                                    "num_experts_per_tok", "moe_intermediate_size", "index_n_heads", "index_head_dim", "hc_mult",
                                    "index_topk")}  # the peak model reads the top-k (the sparse attention's gathered rows)
    kinds = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
    config.update(model_type="deepseek_v4", num_hidden_layers=61, num_nextn_predict_layers=1,
                  layer_types=[kinds[r] for r in block["compress_ratios"]])
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert plan_fit("--model", str(tmp_path), "--gpu", "GB300", "--gpus", "256", "--json")[1]["meshes"] == \
        plan_fit("--model", "pro", "--gpu", "GB300", "--gpus", "256", "--json")[1]["meshes"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpu", "H200"], "--fit needs --gpus"),
        (["--gpu", "A100", "--gpus", "64"], "known: ['B200'"),
        (["--gpu", "H200", "--gpus", "3-7"], "holds no multiple of 8 GPUs per node"),
        (["--gpu", "H200", "--gpus", "64", "--model", "/nonexistent"], "expected flash, pro, v41_flash, a config.json"),
        (["--gpu", "H200", "--gpus", "64", "--headroom", "1.5"], "headroom is 1.5"),
    ],
)
def test_plan_fit_bad_input(args, message, capsys):
    from verl_ds4.cli import main

    assert main(["plan", "--fit", *args]) == 2
    assert message in capsys.readouterr().err
