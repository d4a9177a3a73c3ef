"""verl 0.9.1's own Megatron engine build on the CPU with the production model (verl_ds4.cpu.production_engine):
verl's ``_build_tf_config`` / ``_build_megatron_module`` run unchanged (Megatron-Bridge's provider builds Megatron-LM
dev's DeepSeek-V4, Bridge loads the folder), constructed by verl's ``TrainingWorker`` from verl's config tree.

tests/production_engine_folder.py writes the tiny DS4 (the CPU SFT assets, weights in DeepSeek's native names) here,
on the released megatron-core; tests/production_engine_checks.py runs the engines in a fresh interpreter whose
megatron is Megatron-LM dev (the default proven commit), on 1 and 2 gloo ranks:

* the LM engine's log-probs (verl's ``infer_batch`` of a packed batch of 4 chat conversations) equal
  :class:`verl_ds4.verify.production.ProductionBuilder` on the same folder (the same Bridge calls by hand): float32,
  bound 1e-5 (measured 5.5e-7); control: the reference of a folder with one tensor changed is beyond the bound;
* CP = 2 log-probs (and the first training loss) equal CP = 1's (bound 1e-5);
* ``train_batch``: losses finite, falling over two steps, the weights move; the first loss is verl's SFT loss of the
  inferred log-probs;
* every forward runs under :class:`verl_ds4.substitutes.precision.StableTopK`, the reference's tie rule: the tiny
  model's indexer scores tie at 0, and without the rule torch's top-k tie order differs between CP 1 and CP 2 and
  between the forward-only and the training forward (first loss 4.901107 at CP 1, 4.900463 at CP 2, against 4.900388);
* the critic (verl's value head on the Bridge-built model: Bridge's ``make_value_model`` hook): values finite,
  CP 2 = CP 1, one training step moves the weights;
* the CPU provider settings arrive through ``engine.override_transformer_config``; a contradicting user value is
  refused naming it, a user's own indexer-loss coefficient is kept; without ``VERL_ENGINE_VENDOR=production`` the
  default CPU engines stay selected; a folder in transformers' names and an HF-format model save that cannot run
  (no ModelOpt for Bridge's ``save_hf_weights``) are refused at start-up;
* verl's SFT trainer (torchrun, 2 processes, CP 2) runs the engine for 3 steps, the loss falls; the same run on
  verl-ds4's own CPU engine and model (same weights, data and settings) gives the same losses within 1e-6 at step 1
  and 1e-5 later (measured 9.5e-8, 1.1e-7, 1.2e-6) once dev's expert-bias update is off
  (``moe_router_bias_update_rate=0``: verl-ds4's own model keeps ``expert_bias`` fixed); with dev's default update
  (1e-3 per step) the later steps differ by 1.4e-4 / 2.4e-4 (the control).

Skipped where the production path cannot run: a Python other than 3.12 or no Megatron-Bridge with its DS4 bridge
(lane 1), or no Megatron-LM dev export (with CI=true and the archives beside the repository that is an error).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from verl_ds4.substitutes import megatron_dev
from verl_ds4.testing.megatron_dev_export import production_marks

REPO = Path(__file__).resolve().parents[1]
COMMIT = megatron_dev.DEFAULT_COMMIT
BOUND = 1e-5  # float32, two data paths over the same weights (measured 5.5e-7 engine vs builder, 4e-7 CP 2 vs 1)
PERTURBED_TENSOR = "layers.1.attn.wq_a.weight"
REFUSED = {
    "refused_grouped_gemm": ["+engine.override_transformer_config.moe_grouped_gemm=True"],
    "refused_coeff_none": ["+engine.override_transformer_config.dsa_indexer_loss_coeff=null"],
    "refused_te": ["+engine.override_transformer_config.transformer_impl=transformer_engine"],
    "refused_vanilla_mbridge": ["engine.vanilla_mbridge=True"],
    "refused_dist_without_path": ["engine.use_dist_checkpointing=True"],
    "refused_transformers_names": ["model.path={transformers_model}"],  # the same weights in transformers' names
    "refused_hf_save": ["engine.forward_only=False"],  # training, the model saved as HF (verl's default contents)
    "kept_coeff": ["+engine.override_transformer_config.dsa_indexer_loss_coeff=0.5",
                   "+engine.override_transformer_config.moe_grouped_gemm=False"],
}


pytestmark = production_marks(COMMIT)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    sys.path.insert(0, str(REPO / "tests"))
    try:
        from production_engine_folder import write_assets
    finally:
        sys.path.remove(str(REPO / "tests"))
    tree = megatron_dev.find(COMMIT)  # unpack here, once
    root = tmp_path_factory.mktemp("production_engine")
    assets = write_assets(root)
    perturbed = root / "perturbed_model"
    shutil.copytree(assets["model"], perturbed)
    tensors = load_file(str(perturbed / "model.safetensors"))
    tensors[PERTURBED_TENSOR] = tensors[PERTURBED_TENSOR].clone()
    tensors[PERTURBED_TENSOR][0] += 0.05
    save_file(tensors, str(perturbed / "model.safetensors"), metadata={"format": "pt"})
    assets["perturbed"] = str(perturbed)
    runs = ["lm1", "lm2", "critic1", "critic2", "reference", "reference_perturbed", *REFUSED]
    args = {"assets": assets, "runs": runs, "refused": REFUSED}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("VERL_ENGINE_VENDOR", None)
    sft = _start_sft(assets, root / "sft_ckpt", env)  # beside the checks: each is mostly one busy process
    done = subprocess.run([sys.executable, str(REPO / "tests" / "production_engine_checks.py"), COMMIT, json.dumps(args)],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        from verl_ds4.cpu.sft_run import kill_run

        kill_run(sft)
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    result = json.loads(lines[-1][len("RESULT "):])
    result["tree"] = str(tree.root)
    out, err = sft.communicate(timeout=900)
    result["sft"] = {"returncode": sft.returncode, "stdout": out, "stderr_tail": err[-4000:]}
    for key, proc in (("sft_fixed_bias", _start_sft(assets, root / "sft_ckpt_fixed_bias", env, extra=[FIXED_BIAS])),
                      ("sft_project", _start_sft(assets, root / "sft_ckpt_project", env, engine="project"))):
        out, err = proc.communicate(timeout=900)
        result[key] = {"returncode": proc.returncode, "stdout": out, "stderr_tail": err[-4000:]}
    return result


SFT_STEPS = 3
#: dev's aux-loss-free balancing moves each router's expert_bias by 1e-3 per step (Megatron's default, kept by
#: Bridge's DS4 provider); verl-ds4's own model keeps expert_bias fixed. Off, the two engines train the same model.
FIXED_BIAS = "+engine.override_transformer_config.moe_router_bias_update_rate=0.0"


def _start_sft(assets: dict, ckpt_dir: Path, env: dict, engine: str = "production",
               extra: tuple[str, ...] | list[str] = ()) -> subprocess.Popen:
    """verl's SFT trainer (torchrun, 2 processes, CP 2) on the folder with the production engine
    (VERL_ENGINE_VENDOR=production). The trainer saves at its last step: no model (see
    test_an_hf_model_save_that_cannot_run_is_refused_at_start_up), the run's extra state only.

    ``engine="project"``: the same run (command, data, seed, settings) on verl-ds4's own CPU engine and its own DS4,
    from the same weights in transformers' names (the released megatron-core of this interpreter)."""
    from verl_ds4.cpu.sft_run import cpu_env, sft_command

    save = "checkpoint.save_contents=[extra]"
    if engine == "project":  # its engine starts from the folder's weights with Megatron's dist checkpointing
        cmd = sft_command({**assets, "model": assets["transformers_model"]}, ckpt_dir=ckpt_dir, steps=SFT_STEPS, cp=2,
                          nproc=2, batch=8, micro_batch=4, lr=3e-3, extra=[save])
        sft_env = cpu_env({k: v for k, v in env.items() if k not in ("VERL_ENGINE_VENDOR", "MEGATRON_DEV_DIR")})
        return subprocess.Popen(cmd, env=sft_env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    engine_assets = {**assets, "external_lib": "verl_ds4.cpu.production_engine"}
    cmd = sft_command(engine_assets, ckpt_dir=ckpt_dir, steps=SFT_STEPS, cp=2, nproc=2, batch=8, micro_batch=4, lr=3e-3,
                      extra=["engine.use_dist_checkpointing=False", save, *extra])
    sft_env = cpu_env(env)
    sft_env.update(VERL_USE_EXTERNAL_MODULES="verl_ds4.cpu.platform,verl_ds4.cpu.production_engine",
                   VERL_ENGINE_VENDOR="production", MEGATRON_DEV_DIR=str(megatron_dev.find(COMMIT).root))
    return subprocess.Popen(cmd, env=sft_env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _diff(got, ref) -> float:
    """Largest |difference| over every token with a next token (the engine's last label wraps around)."""
    return max(float(np.abs(np.array(a[:-1]) - np.array(b[: len(a) - 1])).max()) for a, b in zip(got, ref, strict=True))


def test_the_checks_run_megatron_dev_through_verls_bridge_branch(run):
    assert Path(run["tree"]).resolve() in Path(run["megatron_file"]).resolve().parents
    for name in ("lm1", "lm2", "critic1", "critic2"):
        r = run["runs"][name]
        assert r["engine"].startswith("verl_ds4.cpu.production_engine.ProductionCPUMegatronEngineWith"), r["engine"]
        assert r["gpt"] == "megatron.core.models.gpt.gpt_model"
        assert r["bridge"].startswith("megatron.bridge") and r["provider"] and r["vanilla_bridge"] is False, r
        assert r["devices"] == ["cpu"] and r["dtypes"] == ["torch.float32"]
        assert r["layout"] == "contiguous" and not r["mtp"]  # verl's rule: MTP off drops dev's MTP layers
        assert eval(r["overrides"]["moe_grouped_gemm"]) is False and eval(r["overrides"]["dsa_indexer_loss_coeff"]) == 0.0


def test_the_production_engine_is_selected_by_vendor_and_the_default_cpu_engine_stays(run):
    sel = run["selected"]
    assert sel["language_model/production"] == "verl_ds4.cpu.production_engine.ProductionCPUMegatronEngineWithLMHead"
    assert sel["value_model/production"] == "verl_ds4.cpu.production_engine.ProductionCPUMegatronEngineWithValueHead"
    assert sel["language_model/None"] == "verl_ds4.cpu.engine.CPUMegatronEngineWithLMHead"
    assert sel["value_model/None"] == "verl_ds4.cpu.engine.CPUMegatronEngineWithValueHead"


def test_log_probs_equal_the_production_builder_and_the_control_differs(run):
    lm1, ref, bad = run["runs"]["lm1"], run["runs"]["reference"], run["runs"]["reference_perturbed"]
    assert [len(x) for x in lm1["log_probs"]] == lm1["lengths"]
    diff, control = _diff(lm1["log_probs"], ref["log_probs"]), _diff(lm1["log_probs"], bad["log_probs"])
    print(f"engine vs ProductionBuilder: {diff:.2e}; vs the perturbed folder's: {control:.2e}")
    assert diff <= BOUND
    assert control > 100 * BOUND  # the comparison sees one changed tensor


def test_cp2_equals_cp1(run):
    lm1, lm2 = run["runs"]["lm1"], run["runs"]["lm2"]
    diff = _diff(lm2["log_probs"], lm1["log_probs"])
    print(f"CP 2 vs CP 1 log-probs: {diff:.2e}; first losses {lm1['losses'][0]:.6f} / {lm2['losses'][0]:.6f}")
    assert diff <= BOUND
    assert abs(lm2["losses"][0] - lm1["losses"][0]) <= BOUND * abs(lm1["losses"][0])


def test_training_steps_are_finite_fall_and_move_the_weights(run):
    for name in ("lm1", "lm2"):
        r = run["runs"][name]
        assert r["losses"] and all(math.isfinite(x) for x in r["losses"]), r["losses"]
        assert r["params_moved"] >= 0.9 * r["params"] and r["head_moved"] > 0, r["params_still"]
    losses = run["runs"]["lm1"]["losses"]
    print(f"LM losses (CP 1): {losses}")
    assert losses[1] < losses[0]


def test_the_first_training_loss_is_verls_sft_loss_of_the_inferred_log_probs(run):
    """The training forward computes what the forward-only pass did: verl's SFT loss (mean negative log-prob over the
    loss mask shifted by one) of ``infer_batch``'s log-probs, at CP 1 and 2."""
    lm1 = run["runs"]["lm1"]
    log_probs = np.concatenate([np.array(x) for x in lm1["log_probs"]])
    mask = np.roll(np.concatenate([np.array(x) for x in lm1["loss_mask"]]), -1)
    expected = float(-(log_probs * mask).sum() / mask.sum())
    for name in ("lm1", "lm2"):
        got = run["runs"][name]["losses"][0]
        print(f"{name}: first training loss {got:.7f}, SFT loss of the inferred log-probs {expected:.7f}")
        assert abs(got - expected) <= BOUND * abs(expected)


def test_the_critic_is_verls_value_head_on_the_bridge_model(run):
    c1, c2 = run["runs"]["critic1"], run["runs"]["critic2"]
    assert c1["make_value_model"] == "megatron.bridge.training.utils.train_utils"  # Bridge's hook, not verl's fallback
    assert c1["output_layer"].endswith("LinearForLastLayer")
    assert all(math.isfinite(v) for seq in c1["values"] for v in seq) and [len(x) for x in c1["values"]] == c1["lengths"]
    diff = max(float(np.abs(np.array(a) - np.array(b)).max()) for a, b in zip(c1["values"], c2["values"], strict=True))
    print(f"critic values CP 2 vs CP 1: {diff:.2e}; losses {c1['losses']} / {c2['losses']}")
    assert diff <= BOUND
    for r in (c1, c2):
        assert all(math.isfinite(x) for x in r["losses"]) and r["head_moved"] > 0 and r["params_moved"] >= 0.9 * r["params"]


@pytest.mark.parametrize("name,key", [("refused_grouped_gemm", "moe_grouped_gemm=True"),
                                      ("refused_coeff_none", "dsa_indexer_loss_coeff=None"),
                                      ("refused_te", "transformer_impl='transformer_engine'")])
def test_a_contradicting_user_setting_is_refused_naming_it(run, name, key):
    r = run["runs"][name]
    assert r["refused"] and r["type"] == "ValueError", r
    assert key in r["message"] and "Remove those overrides or set" in r["message"], r["message"]


def test_a_folder_in_transformers_names_is_refused_naming_the_missing_tensors(run):
    """Bridge alone ends in ``KeyError: 'Key not found: layers.0.hc_ffn_scale'``; the engine's load checks the folder
    first. Control: the native folder of the same weights loads (every other run)."""
    r = run["runs"]["refused_transformers_names"]
    assert r["refused"] and r["type"] == "NotNativeFolder", r
    assert "embed.weight" in r["message"] and "native names" in r["message"], r["message"]


def test_an_hf_model_save_that_cannot_run_is_refused_at_start_up(run):
    """Megatron-Bridge 0.6.2's save_hf_weights imports ModelOpt; without it verl's first model save (HF format when
    use_dist_checkpointing=False) would fail after the training. Controls: every training engine here (and the SFT
    run) saves no model and starts; with ModelOpt importable the engine starts."""
    r = run["runs"]["refused_hf_save"]
    if run["modelopt"]:
        assert not r["refused"], r
    else:
        assert r["refused"] and r["type"] == "ValueError", r
        assert "save_hf_weights imports ModelOpt" in r["message"] and "checkpoint.save_contents" in r["message"]


@pytest.mark.parametrize("name,text", [("refused_vanilla_mbridge", "set engine.vanilla_mbridge=False"),
                                       ("refused_dist_without_path", "use_dist_checkpointing=True without "
                                                                      "dist_checkpointing_path")])
def test_settings_the_engine_cannot_build_with_are_refused(run, name, text):
    """Controls: every other run has vanilla_mbridge=False and use_dist_checkpointing=False, and builds."""
    r = run["runs"][name]
    assert r["refused"] and r["type"] == "ValueError" and text in r["message"], r


def test_the_users_own_settings_are_kept(run):
    """Control of the refusals: the same keys with values the CPU can run build the engine, the user's coefficient
    reaching the provider unchanged."""
    r = run["runs"]["kept_coeff"]
    assert not r["refused"], r
    assert eval(r["overrides"]["dsa_indexer_loss_coeff"]) == 0.5 and eval(r["provider"]["dsa_indexer_loss_coeff"]) == 0.5
    assert eval(r["provider"]["moe_grouped_gemm"]) is False


def test_verls_sft_trainer_runs_the_production_engine_at_cp2_and_the_loss_falls(run):
    from verl_ds4.cpu.sft_run import parse_losses

    sft = run["sft"]
    assert sft["returncode"] == 0, sft["stderr_tail"]
    assert "verl-ds4 ProductionCPUMegatronEngineWithLMHead: contiguous CP layout (cp=2" in sft["stdout"]
    losses = parse_losses(sft["stdout"])
    print(f"verl SFT trainer, production engine, CP 2: losses {losses}")
    assert sorted(losses) == list(range(1, SFT_STEPS + 1)) and all(math.isfinite(x) for x in losses.values())
    assert losses[SFT_STEPS] < losses[1]


def test_verls_sft_trainer_gives_the_same_losses_on_the_production_engine_and_on_the_project_s(run):
    """The same SFT run (verl's trainer, CP 2, float32, 3 steps of Adam at lr 3e-3, same seeded weights and data) on
    the production engine (dev's DS4 built by Bridge) with dev's expert-bias update off and on verl-ds4's own CPU engine
    and model: step 1 within 1e-6 relative, steps 2 and 3 within 1e-5 (measured 9.5e-8, 1.1e-7, 1.2e-6: float32 sums
    in another order; the project's engine at CP 1 vs CP 2 differs by 1e-7 at every step).

    Control: the production run with dev's default expert-bias update (1e-3 per step: the routing of step 2 on moves)
    differs from the project's run by more than the bound (measured 1.4e-4, 2.4e-4), so the bound sees a change of
    the model's math that leaves step 1 alone."""
    from verl_ds4.cpu.sft_run import parse_losses

    prod, own, moving = run["sft_fixed_bias"], run["sft_project"], run["sft"]
    assert prod["returncode"] == 0 and own["returncode"] == 0, (prod["stderr_tail"], own["stderr_tail"])
    assert "verl-ds4 CPUMegatronEngineWithLMHead: contiguous CP layout (cp=2" in own["stdout"] + own["stderr_tail"]
    a, b, c = parse_losses(prod["stdout"]), parse_losses(own["stdout"]), parse_losses(moving["stdout"])
    assert sorted(a) == sorted(b) == sorted(c) == list(range(1, SFT_STEPS + 1))
    rel = {s: abs(a[s] - b[s]) / abs(b[s]) for s in b}
    rel_moving = {s: abs(c[s] - b[s]) / abs(b[s]) for s in b}
    print(f"SFT losses, production engine (expert bias fixed) {a}; project engine {b}; relative differences {rel}; "
          f"production engine with dev's expert-bias update {c}: {rel_moving}")
    assert rel[1] <= 1e-6 and max(rel.values()) <= 1e-5, rel
    assert rel_moving[1] <= 1e-6 and max(rel_moving.values()) > 1e-5, rel_moving  # the control
