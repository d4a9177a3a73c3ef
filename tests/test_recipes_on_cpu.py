"""DS4 recipes: composition through verl's real config tree, start-up validation, launchers.

Every recipe is composed with Hydra's compose API on verl 0.9.1's own ``sft_trainer_engine`` /
``ppo_trainer`` configs (the files verl's entry points read), validated against real local paths,
and its engine/actor/critic/rollout sections are instantiated into verl's config dataclasses. Each
bad configuration the issue lists must raise an error naming the setting. The launchers run as
subprocesses: ``--dry-run`` must exit 0 and print the plan; the real-run path is exercised with a
stand-in ``torchrun`` / Python on PATH that records its arguments (no GPU).
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from verl_ds4.recipes.compose import compose_recipe
from verl_ds4.recipes.gsm8k import prepare
from verl_ds4.recipes.plan import format_plan
from verl_ds4.recipes.validate import RecipeValidationError, validate_recipe

REPO = Path(__file__).resolve().parents[1]
TRAINER = {"sft": "sft", "ppo": "ppo", "grpo": "ppo"}

GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
    {"question": "A box holds 12 eggs. How many eggs in 2 boxes?", "answer": "12*2=<<12*2=24>>24\n#### 24"},
]


def _write_model(path: Path, **fields) -> Path:
    config = {
        "model_type": "deepseek_v4",
        "num_hidden_layers": 43,
        "num_nextn_predict_layers": 1,
        "hidden_size": 4096,
        "n_routed_experts": 256,
        "num_experts_per_tok": 6,
        "sliding_window": 128,
    }
    config.update(fields)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A DS4-Flash-shaped model folder and GSM8K SFT/RL parquet files made by our preparation code."""
    root = tmp_path_factory.mktemp("ds4_assets")
    model = _write_model(root / "DeepSeek-V4-Flash")
    pro = _write_model(root / "DeepSeek-V4-Pro", num_hidden_layers=61, hidden_size=7168, n_routed_experts=384)
    raw = root / "gsm8k_raw"
    raw.mkdir()
    for split in ("train", "test"):
        with open(raw / f"{split}.jsonl", "w") as f:
            for row in GSM8K_ROWS:
                f.write(json.dumps(row) + "\n")
    written = prepare(str(raw), str(root / "sft"), str(root / "rl"), ["train", "test"])
    assert len(written) == 4 and all(n == 2 for n in written.values())
    return {"model": model, "pro": pro, "root": root}


def _paths(kind: str, assets, model_key: str = "model") -> list[str]:
    data = assets["root"] / ("sft" if kind == "sft" else "rl")
    model_field = "model.path" if kind == "sft" else "actor_rollout_ref.model.path"
    return [
        f"{model_field}={assets[model_key]}",
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'test.parquet'}",
    ]


def _validate(kind: str, overrides: list[str], dry_run: bool = False, **kw):
    cfg = compose_recipe(kind, overrides)
    return cfg, validate_recipe(cfg, TRAINER[kind], dry_run=dry_run, **kw)


# ---------------------------------------------------------------- composition and valid recipes


@pytest.mark.parametrize("kind", ["ppo", "grpo"])
def test_gpu_rl_recipes_build_the_run_record_callback(kind, assets, tmp_path):
    """The GPU RL recipes select verl-ds4's checkpoint callback (resume check, step manifests before the tracker,
    the driver's node watch; verl_ds4/recipes/resume_check.py), as the CPU recipe does: verl's own builder makes it
    from the composed config and it records the run's mesh. Control: verl's default (no class) builds none of it."""
    from verl.trainer.ppo.checkpoint_callback import build_checkpoint_callback

    from verl_ds4.engine import checkpoint as ck
    from verl_ds4.recipes.resume_check import RECORD_NAME, RunRecordCallback

    cfg = compose_recipe(kind, _paths(kind, assets) + [f"trainer.default_local_dir={tmp_path}"])
    assert cfg.trainer.checkpoint_callback_class == "verl_ds4.recipes.resume_check.RunRecordCallback"
    try:
        callback = build_checkpoint_callback(cfg)
    finally:
        ck.uninstall_trainer_hook()  # the callback wraps verl's trainer in this process
    assert isinstance(callback, RunRecordCallback)
    identity = json.loads((tmp_path / RECORD_NAME).read_text())["identity"]
    assert identity["actor_rollout_ref.actor.megatron.context_parallel_size"] == cfg.ds4.mesh.cp
    assert identity["trainer.nnodes"] == cfg.ds4.mesh.nnodes
    default = compose_recipe(kind, _paths(kind, assets) + [f"trainer.default_local_dir={tmp_path / 'plain'}",
                                                           "trainer.checkpoint_callback_class=null"])
    assert not isinstance(build_checkpoint_callback(default), RunRecordCallback)
    assert not (tmp_path / "plain" / RECORD_NAME).exists()


@pytest.mark.parametrize(
    "kind, mesh",
    [
        ("sft", "h200_64gpu_pp8_ep8_cp2"),
        ("sft", "h200_64gpu_pp4_ep8_cp4"),
        ("ppo", "h200_64gpu_pp8_ep8_cp2"),
        ("ppo", "h100_128gpu_pp8_ep8_cp2"),
        ("grpo", "gb200_40gpu_pp5_ep8_cp2"),
    ],
)
def test_flash_recipes_compose_and_validate_with_real_paths(kind, mesh, assets):
    cfg, report = _validate(kind, _paths(kind, assets) + [f"ds4_mesh={mesh}"])
    assert report.errors == [] and report.warnings == []
    assert report.facts.source.endswith("config.json")
    mesh_cfg = cfg.ds4.mesh
    assert report.world_size == mesh_cfg.nnodes * mesh_cfg.gpus_per_node
    engine = cfg.engine if kind == "sft" else cfg.actor_rollout_ref.actor.megatron
    # The knobs reached the engine verl builds, with DS4's provider settings.
    assert engine.context_parallel_size == mesh_cfg.cp and engine.pipeline_model_parallel_size == mesh_cfg.pp
    assert engine.expert_model_parallel_size == mesh_cfg.ep and engine.tensor_model_parallel_size == 1
    assert engine.use_mbridge is True and engine.vanilla_mbridge is False
    assert engine.override_transformer_config.cp_partition_mode == "contiguous"
    # the attention kernel path and the recompute the mesh names for its GPU reach Megatron's config
    otc = engine.override_transformer_config
    assert otc.dsa_kernel_backend == mesh_cfg.dsa_kernel_backend in ("none", "cudnn")
    assert engine.sparse_attention == mesh_cfg.sparse_attention == ("linear" if otc.dsa_kernel_backend == "none" else "megatron")
    assert otc.recompute_granularity == mesh_cfg.recompute_granularity == "full" and otc.recompute_method == "uniform"
    if kind == "sft":
        assert cfg.model.use_remove_padding is True and cfg.model.mtp.enable is True
        assert cfg.data.custom_cls.name == "DS4ChatSFTDataset"
        assert cfg.trainer.nnodes == mesh_cfg.nnodes
    else:
        assert cfg.model_engine == "megatron"
        assert cfg.actor_rollout_ref.model.use_remove_padding is True
        assert cfg.actor_rollout_ref.model.mtp.enable is False
        assert cfg.data.filter_overlong_prompts is True and cfg.data.custom_cls.name == "DS4RLHFDataset"
    roles = [r.role for r in report.roles]
    assert roles == {"sft": ["sft"], "ppo": ["actor", "critic"], "grpo": ["actor", "ref"]}[kind]
    if kind == "ppo":
        assert cfg.algorithm.adv_estimator == "gae" and cfg.critic.model.mtp.enable is False
        assert cfg.critic.megatron.context_parallel_size == mesh_cfg.cp
    if kind == "grpo":
        assert cfg.algorithm.adv_estimator == "grpo" and cfg.actor_rollout_ref.actor.use_kl_loss is True
        assert cfg.actor_rollout_ref.ref.megatron.context_parallel_size == mesh_cfg.cp


def test_recipe_sections_instantiate_as_verl_dataclasses(assets):
    """The sections verl turns into dataclasses accept every key the recipes set."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import McoreActorConfig, McoreCriticConfig, McoreEngineConfig, RolloutConfig

    from verl_ds4.engine.config import DS4McoreEngineConfig

    cfg = compose_recipe("sft", _paths("sft", assets) + ["ds4.mesh.cp=2", "ds4.cp_balance=ds4"])
    engine = omega_conf_to_dataclass(cfg.engine)
    assert isinstance(engine, DS4McoreEngineConfig) and isinstance(engine, McoreEngineConfig)
    assert engine.context_parallel_size == 2 and engine.cp_balance == "ds4"
    assert omega_conf_to_dataclass(compose_recipe("sft", _paths("sft", assets)).engine).cp_balance is None  # off by default
    omega_conf_to_dataclass(cfg.optim)
    cfg = compose_recipe("ppo", _paths("ppo", assets) + ["ds4.router_replay=R2", "ds4.cp_balance=dense"])
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor, McoreActorConfig) and actor.megatron.router_replay.mode == "R2"
    assert isinstance(actor.megatron, DS4McoreEngineConfig) and actor.megatron.cp_balance == "dense"
    ref_engine = omega_conf_to_dataclass(cfg.actor_rollout_ref.ref.megatron)
    assert isinstance(ref_engine, DS4McoreEngineConfig) and ref_engine.cp_balance == "dense"
    cfg.critic.pop("model")  # HFModelConfig would load the (fake) checkpoint
    critic = omega_conf_to_dataclass(cfg.critic)
    assert isinstance(critic, McoreCriticConfig) and critic.megatron.cp_balance == "dense"
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    assert isinstance(rollout, RolloutConfig) and rollout.name == "vllm" and rollout.tensor_model_parallel_size == 8


def test_pro_recipe_uses_pro_facts_and_meshes(assets):
    cfg, report = _validate("sft", _paths("sft", assets, "pro") + ["ds4_model=pro", "ds4_mesh=gb300_256gpu_pp4_ep64"])
    assert report.errors == [] and report.facts.n_routed_experts == 384 and report.facts.num_layers == 61
    assert cfg.ds4.model.index_topk == 1024
    # Without a readable checkpoint the recipe's Pro block is used (dry-run), EP 64 divides 384 experts.
    cfg, report = _validate("grpo", ["ds4_model=pro", "ds4_mesh=gb300_256gpu_pp4_ep64"], dry_run=True)
    assert report.errors == [] and report.facts.source.startswith("recipe") and report.facts.n_routed_experts == 384
    assert cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 16 and cfg.actor_rollout_ref.rollout.quantization == "fp8"
    # The 32-GPU GB300 mesh the launchers once suggested for Pro cannot hold Pro's states: refused.
    with pytest.raises(RecipeValidationError, match=r"actor memory: .*states 900\.3 .*exceeds 251\.1 GiB, the 279\.0 GiB of one GB300.*\(the states alone exceed it\)"):
        _validate("grpo", ["ds4_model=pro", "ds4_mesh=gb300_32gpu_pp4_ep8"], dry_run=True)


def test_user_override_wins_over_knob_and_is_not_rewritten(assets):
    cfg, report = _validate("sft", _paths("sft", assets) + ["engine.context_parallel_size=2", "ds4.mesh.cp=4"])
    assert cfg.engine.context_parallel_size == 2 and report.roles[0].cp == 2


# ---------------------------------------------------------------- each bad case names its setting

BAD_CASES = [
    ("world_not_divisible", "sft", ["ds4.mesh.cp=3"], "is not divisible by TPxPPxCP=24"),
    ("ep_not_dividing_experts", "sft", ["ds4.mesh.nnodes=3", "ds4.mesh.ep=6"], "EP=6 does not divide the 256 routed experts"),
    ("tp_gt_1", "sft", ["ds4.mesh.tp=2"], "engine.tensor_model_parallel_size: is 2, but DS4's hybrid attention does not support"),
    ("cp_without_thd", "sft", ["ds4.mesh.cp=2", "model.use_remove_padding=false"], "model.use_remove_padding: is False with CP=2"),
    ("critic_cp_without_thd", "ppo", ["ds4.mesh.cp=2", "critic.model.use_remove_padding=false"], "critic.model.use_remove_padding: is False"),
    ("zigzag", "sft", ["ds4.mesh.cp=2", "ds4.cp_partition_mode=zigzag"], "cp_partition_mode: is 'zigzag' with CP=2"),
    ("zigzag_direct", "ppo", ["ds4.mesh.cp=2", "critic.megatron.override_transformer_config.cp_partition_mode=zigzag"], "critic.megatron.override_transformer_config.cp_partition_mode: is 'zigzag'"),
    ("budget_below_rows", "sft", ["ds4.mesh.cp=4", "ds4.max_token_len_per_gpu=100", "data.max_length=256"], "below the CP x 128 = 512 rows"),
    ("budget_below_seq", "ppo", ["ds4.max_token_len_per_gpu=1024"], "cannot hold one sequence of the maximum length 3072"),
    ("ref_mesh_disagrees", "grpo", ["actor_rollout_ref.ref.megatron.context_parallel_size=4"], "actor_rollout_ref.ref.megatron.context_parallel_size: is 4 but the actor uses 2"),
    ("ref_layout_disagrees", "grpo", ["ds4.mesh.cp=2", "actor_rollout_ref.ref.megatron.override_transformer_config={cp_partition_mode:zigzag}"], "reference log-probs would be computed on a different token layout"),
    ("critic_mtp", "ppo", ["critic.model.mtp.enable=true"], "critic.model.mtp.enable: is True, but a value head has no MTP"),
    ("critic_dynamic_cp", "ppo", ["critic.megatron.dynamic_context_parallel=true", "critic.megatron.max_seqlen_per_dp_cp_rank=4096"], "dynamic CP supports language models only"),
    ("dynamic_cp_cap", "sft", ["ds4.dynamic_cp=true", "ds4.max_seqlen_per_dp_cp_rank=64"], "max_seqlen_per_dp_cp_rank: is 64 with dynamic CP"),
    ("rollout_tp", "ppo", ["ds4.rollout.tp=3"], "actor_rollout_ref.rollout.tensor_model_parallel_size: rollout replicas of TPxDPxPP=3x1x1=3 GPUs do not divide the 64 GPUs"),
    ("r3_without_rollout_routes", "grpo", ["ds4.router_replay=R3"], "enable_rollout_routing_replay: is False while router_replay.mode=R3"),
    ("filter_overlong", "ppo", ["data.custom_cls.path=null", "data.custom_cls.name=null"], "DS4 checkpoints ship no chat template"),
    ("indexer_replay_with_vllm", "grpo", ["ds4.indexer_replay=true"], "indexer_replay: is True, but rollout.name=vllm returns no indexer choices"),
    ("resume_path_empty", "sft", ["trainer.resume_mode=resume_path"], "is empty while trainer.resume_mode=resume_path"),
    ("cp_zero", "sft", ["ds4.mesh.cp=0"], "engine.context_parallel_size: is 0; parallel sizes must be >= 1"),
    ("cp_not_int", "sft", ["ds4.mesh.cp=abc"], "engine.context_parallel_size: is 'abc', not an integer"),
    ("pp_gt_layers", "sft", ["ds4.mesh.pp=64", "ds4.mesh.nnodes=8"], "PP=64 exceeds the 43 decoder layers"),
    ("cp_balance_unknown", "sft", ["ds4.cp_balance=fast"], "engine.cp_balance: is 'fast'; expected null"),
    ("tilelang", "sft", ["ds4.dsa_kernel_backend=tilelang"], "is 'tilelang', which Megatron-LM dev refuses for DeepSeek-V4"),
    ("backend_unknown", "ppo", ["ds4.dsa_kernel_backend=flash"], "is 'flash'; expected one of ['cudnn', 'none']"),
    ("fused_dense_indexer_loss_sm90", "sft", ["ds4.dsa_kernel_backend=cudnn", "ds4.sparse_attention=megatron", "ds4.indexer_loss_coeff=0.01"], "with the dense indexer loss on SM90"),
    ("linear_core_with_fused_backend", "ppo", ["ds4.dsa_kernel_backend=cudnn"], "actor_rollout_ref.actor.megatron.sparse_attention: is linear with dsa_kernel_backend=cudnn"),
    ("sparse_attention_unknown", "sft", ["ds4.sparse_attention=fast"], "engine.sparse_attention: is 'fast'; expected one of ['megatron', 'linear']"),
    ("selective_with_full_settings", "sft", ["ds4.recompute_granularity=selective", "ds4.recompute_modules=[moe_act,mhc]"], "is selective with recompute_method and recompute_num_layers set"),
    ("selective_modules_null", "sft", ["ds4.recompute_granularity=selective", "ds4.recompute_method=null", "ds4.recompute_num_layers=null"], "is null with recompute_granularity=selective: Megatron then recomputes core_attn"),
    ("selective_without_modules", "sft", ["ds4.recompute_granularity=selective", "ds4.recompute_modules=[]", "ds4.recompute_method=null", "ds4.recompute_num_layers=null"], "Megatron then recomputes nothing"),
    ("recompute_core_attn", "sft", ["ds4.recompute_granularity=selective", "ds4.recompute_modules=[moe_act,core_attn]"], "contains core_attn"),
    ("recompute_unknown", "ppo", ["ds4.recompute_granularity=selective", "ds4.recompute_modules=[moe_act,attention]"], "has ['attention'], not modules DeepSeek-V4 recomputes"),
    ("recompute_mhc_mlp", "sft", ["ds4.recompute_granularity=selective", "ds4.recompute_modules=[mhc,mlp]"], "has both mhc and mlp"),
    ("full_without_method", "sft", ["ds4.recompute_method=null"], "is full without recompute_method"),
    ("recompute_granularity_unknown", "sft", ["ds4.recompute_granularity=some"], "is 'some'; expected null, selective or full"),
    ("headroom_out_of_range", "sft", ["ds4.memory_headroom=1.5"], "ds4.memory_headroom: headroom is 1.5; expected a fraction in [0, 1)"),
    ("host_memory_negative", "sft", ["ds4.mesh.host_memory_gib=-1"], "ds4.mesh.host_memory_gib: ds4.mesh.host_memory_gib is -1"),
    ("cp_balance_on_verls_config", "ppo", ["ds4.cp_balance=ds4", "critic.megatron._target_=verl.workers.config.McoreEngineConfig"], "critic.megatron._target_: is 'verl.workers.config.McoreEngineConfig', which has no cp_balance field"),
]


@pytest.mark.parametrize("name, kind, overrides, expected", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_configuration_raises_error_naming_setting(name, kind, overrides, expected, assets):
    with pytest.raises(RecipeValidationError) as info:
        _validate(kind, _paths(kind, assets) + overrides)
    message = str(info.value)
    assert expected in message, message
    assert "Fix:" in message


def test_missing_paths_are_errors_in_real_runs_and_warnings_in_dry_run(tmp_path):
    missing = [f"model.path={tmp_path / 'no_model'}", f"data.train_files={tmp_path / 'no.parquet'}", "data.val_files=null"]
    with pytest.raises(RecipeValidationError) as info:
        _validate("sft", missing)
    assert "model.path:" in str(info.value) and "data.train_files:" in str(info.value)
    _, report = _validate("sft", missing, dry_run=True)
    assert report.errors == [] and {w.setting for w in report.warnings} == {"model.path", "data.train_files"}
    assert all("dry-run" in w.message for w in report.warnings)
    _, report = _validate("sft", missing + ["ds4.check_paths=false"])
    assert report.errors == [] and [w.setting for w in report.warnings] == ["ds4.check_paths"]


def test_checkpoint_config_overrides_recipe_facts(assets, tmp_path):
    model = _write_model(tmp_path / "small", n_routed_experts=20)
    overrides = _paths("sft", assets)[1:] + [f"model.path={model}"]
    with pytest.raises(RecipeValidationError, match=r"EP=8 does not divide the 20 routed experts .*config.json"):
        _validate("sft", overrides)
    other = _write_model(tmp_path / "qwen", model_type="qwen2")
    with pytest.raises(RecipeValidationError, match="model_type='qwen2'"):
        _validate("sft", _paths("sft", assets)[1:] + [f"model.path={other}"])


def test_config_without_recipe_is_rejected():
    from hydra import compose, initialize_config_dir

    from verl_ds4.recipes.compose import verl_config_dir

    with initialize_config_dir(config_dir=verl_config_dir(), version_base=None):
        plain = compose("sft_trainer_engine")
    with pytest.raises(RecipeValidationError, match=r"\+recipe: no DS4 recipe is selected"):
        validate_recipe(plain, "sft")


def test_plan_shows_resolved_mesh_and_overridden_fields(assets):
    cfg, report = _validate("sft", _paths("sft", assets) + ["ds4.mesh.nnodes=16", "ds4.mesh.cp=4"])
    plan = format_plan(cfg, report)
    assert "16 nodes x 8 GPUs = 128 GPUs" in plan and "overridden: nnodes 8->16, cp 2->4" in plan
    assert "sft   1   8   -    4   8   1    4   2          contiguous" in plan
    assert "43 layers over PP8 -> [6, 6, 6, 5, 5, 5, 5, 5]" in plan and "validation: OK" in plan


# ---------------------------------------------------------------- launchers


def _launcher_env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NNODES", "GPUS_PER_NODE", "PP", "EP", "CP", "MESH")}
    env.update({"PYTHON": sys.executable, **extra})
    return env


@pytest.mark.parametrize("kind", ["sft", "ppo", "grpo"])
def test_launcher_dry_run_prints_plan(kind):
    script = REPO / "scripts" / f"run_deepseek_v4_flash_{kind}_megatron.sh"
    env = _launcher_env(NNODES="8", GPUS_PER_NODE="8", PP="8", EP="8", CP="4", TOKENS_PER_GPU="1024")
    out = subprocess.run(["bash", str(script), "--dry-run"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "dry-run: composed and validated without GPUs" in out.stdout
    assert "8 nodes x 8 GPUs = 64 GPUs" in out.stdout and "validation: OK (0 errors" in out.stdout
    first_role = "sft" if kind == "sft" else "actor"
    assert any(line.split()[:5] == [first_role, "1", "8", "-", "4"] for line in out.stdout.splitlines()), out.stdout
    assert re.search(rf"{first_role} +update +PP8/EP8/CP4 .* 1024 .* yes", out.stdout), out.stdout  # the budget reached the check
    trainer = {"sft": "sft", "ppo": "ppo", "grpo": "ppo"}[kind]
    assert f"DS4 recipe plan: {kind} ({trainer} trainer)" in out.stdout  # GRPO runs the PPO launcher's code
    assert "contiguous" in out.stdout


def _stub(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_sft_launcher_validates_then_execs_torchrun(assets, tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    record = tmp_path / "torchrun_args.txt"
    _stub(bindir / "torchrun", f'printf "%s\\n" "$@" > {record}\n')
    script = REPO / "scripts" / "run_deepseek_v4_flash_sft_megatron.sh"
    data = assets["root"] / "sft"
    env = _launcher_env(
        PATH=f"{bindir}:{os.environ['PATH']}",
        MODEL_PATH=str(assets["model"]),
        TRAIN_FILES=str(data / "train.parquet"),
        VAL_FILES=str(data / "test.parquet"),
        MESH="h200_64gpu_pp4_ep8_cp4",
        CKPT_DIR=str(tmp_path / "ckpt"),
        SHARED_CKPT_TIMEOUT="2",
    )
    # One machine standing in for node 0 of the mesh's 8: the shared-folder check waits for the other 7 and refuses.
    out = subprocess.run(["bash", str(script), "optim.lr=2e-6"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and not record.exists(), out.stderr[-3000:]
    assert f"the checkpoint folder {tmp_path / 'ckpt'} is not shared by the run's 8 nodes: node 0" in out.stderr
    env["SHARED_CKPT_CHECK"] = "0"  # a one-machine rehearsal of the launch: the check is skipped, and says so
    out = subprocess.run(["bash", str(script), "optim.lr=2e-6"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "not checked for being shared by every node (SHARED_CKPT_CHECK=0)" in out.stdout + out.stderr
    args = record.read_text().splitlines()
    assert args[:2] == ["--nnodes=8", "--nproc_per_node=8"] and "verl.trainer.sft_trainer" in args
    assert "+recipe=deepseek_v4_sft" in args and "ds4_mesh=h200_64gpu_pp4_ep8_cp4" in args
    assert args[-1] == "optim.lr=2e-6" and f"trainer.default_local_dir={tmp_path / 'ckpt'}" in args
    assert "validation: OK" in out.stderr  # the plan went to stderr before the exec

    # A rejected configuration stops before torchrun: CP=3 does not divide 64 GPUs with PP4.
    record.unlink()
    out = subprocess.run(["bash", str(script)], env={**env, "CP": "3"}, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and not record.exists()
    assert "is not divisible by TPxPPxCP=12" in out.stderr


def test_verl_entry_point_composes_the_same_config(tmp_path):
    """verl's own `python -m verl.trainer.main_ppo` (its @hydra.main) resolves the launcher's
    overrides to exactly the config the dry-run validated (Hydra's --cfg job prints it, no run)."""
    import yaml
    from omegaconf import OmegaConf

    overrides = [
        "hydra.searchpath=[pkg://verl_ds4.recipes_data,pkg://verl_ds4.configs_data]",
        "+recipe=deepseek_v4_ppo",
        "ds4_mesh=h200_64gpu_pp4_ep8_cp4",
        "ds4.rollout.tp=4",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", *overrides, "--cfg", "job", "--resolve"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    from_entry_point = yaml.safe_load(out.stdout)
    assert from_entry_point == OmegaConf.to_container(compose_recipe("ppo", overrides))
    assert from_entry_point["actor_rollout_ref"]["actor"]["megatron"]["context_parallel_size"] == 4
    assert from_entry_point["actor_rollout_ref"]["rollout"]["tensor_model_parallel_size"] == 4
