"""The peak model counts the logits step that runs (verl's fused kernel or the non-fused ``[T, V]`` logits, per role)
and the rollout's KV cache for the recipe's lengths and concurrency (verl_ds4/memory/rollout.py), each with negative
controls: a recipe with the fused kernel off is modelled with the full logits and refused where the fused one is
accepted; a KV cache that does not fit vLLM's share beside the weights is refused, and every lever the refusal names
makes it fit (one step short of the concurrency lever does not). About 30 s on CPU (compositions and start-up checks)."""

from __future__ import annotations

import re

import pytest

from tests.test_memory_on_cpu import sizes
from verl_ds4.memory import terms
from verl_ds4.memory.peak import StepShape, step_peak
from verl_ds4.memory.rollout import engine_sequences, kv_cache_gib
from verl_ds4.memory.types import RolloutInput
from verl_ds4.recipes import long_context as lc
from verl_ds4.recipes.compose import compose_recipe
from verl_ds4.recipes.validate import validate_recipe

GIB = 2**30


def _report(kind: str, overrides: list[str], trainer: str = "ppo"):
    return validate_recipe(compose_recipe(kind, overrides), trainer, dry_run=True, raise_on_error=False)


# ---------------------------------------------------------------- the logits step
def test_the_last_stage_counts_the_logits_of_the_kernel_that_runs():
    flash = sizes("flash")
    ratios, v, t = [0], flash.vocab_size, 16384
    shape = StepShape(t)
    for pass_, training in (("logprob", False), ("ref", False), ("actor", True), ("sft", True)):
        unfused = step_peak(flash, ratios, path="linear", shape=shape, training=training, logits=pass_, margin=False)
        fused = step_peak(flash, ratios, path="linear", shape=shape, training=training, logits=pass_, logits_kernel="fused",
                          margin=False)
        want = terms.logits_step_bytes(pass_, vocab=v, hidden=flash.hidden_size, kind="fused")
        assert fused.logits_gib == pytest.approx(want.at(t) / GIB)
        assert unfused.logits_gib == pytest.approx(terms.UNFUSED_BYTES_PER_LOGIT[pass_] * v * t / GIB)
        assert unfused.logits_gib > 10 * fused.logits_gib  # negative control: the two kernels differ by ~10-60x
    mtp = step_peak(flash, ratios, path="linear", shape=shape, logits="sft", mtp_depths=1, margin=False)
    assert mtp.logits_gib == pytest.approx((8 + 6) * v * t / GIB)  # MTP only on the non-fused path
    with pytest.raises(ValueError, match="logits kernel 'triton'"):
        step_peak(flash, ratios, path="linear", shape=shape, logits="sft", logits_kernel="triton")


def test_each_role_reads_the_kernel_verl_runs():
    kernels = lambda report: {rm.role: rm.logits_kernel for rm in report.memory.roles}  # noqa: E731
    assert kernels(_report("grpo", [])) == {"actor": "fused", "ref": "fused"}  # the V4 RL recipes' use_fused_kernels
    assert kernels(_report("ppo", [])) == {"actor": "fused", "critic": "unfused"}  # a value head
    assert kernels(_report("grpo", ["actor_rollout_ref.model.use_fused_kernels=false"])) == {"actor": "unfused", "ref": "unfused"}
    assert kernels(_report("sft", [], "sft")) == {"sft": "unfused"}  # V4 SFT trains MTP: verl has no fused MTP
    # fused with MTP on: refused by the validator, and counted as what verl would run (it turns fused off)
    mtp = _report("grpo", ["ds4.mtp=true"])
    assert kernels(mtp) == {"actor": "unfused", "ref": "unfused"}
    assert any(e.setting == "actor_rollout_ref.model.use_fused_kernels" for e in mtp.errors)


def test_the_unfused_logits_refuse_what_the_fused_kernel_fits():
    """GB300 Flash GRPO at 147,456 tokens, PP 1 (the head on every GPU): accepted with the recipe's fused kernel,
    refused with the non-fused logits (their ``[T, V]`` buffers alone are ~8 GiB more at 73,728 tokens a GPU)."""
    setting = next(s for s in lc.SETTINGS if s.name == "Flash GRPO, 128 GB300")
    fused = lc.judge(setting, setting.longest, pin_cp=True)
    unfused = lc.judge(setting, setting.longest, pin_cp=True, extra=("actor_rollout_ref.model.use_fused_kernels=false",))
    assert fused.accepted, fused.errors
    assert not unfused.accepted and any(e.startswith("actor memory") for e in unfused.errors), unfused.errors
    assert unfused.peak_gib > unfused.limit_gib >= fused.peak_gib


def test_the_table_names_the_logits_kernel():
    from verl_ds4.memory.table import format_memory

    lines = format_memory(_report("grpo", ["actor_rollout_ref.model.use_fused_kernels=false"]).memory)
    assert re.search(r"actor +update .* unfused 7\.9 ", "\n".join(lines))
    assert re.search(r"actor +update .* fused 1\.1 ", "\n".join(format_memory(_report("grpo", []).memory)))


# ---------------------------------------------------------------- the rollout's KV cache
def test_sequences_per_engine_and_the_cache_per_gpu():
    r = RolloutInput("vllm", 8, None, 0.6, 1024, 2048, max_num_seqs=256, batch_sequences=1024)
    assert engine_sequences(r, 64) == 128  # 1,024 sequences over 8 engines of TP 8
    assert engine_sequences(r, 64, tp=32) == 256  # capped by max_num_seqs
    assert engine_sequences(RolloutInput("vllm", 8, None, 0.6, max_num_seqs=None, batch_sequences=None), 64) == 1
    flash = sizes("flash")
    assert kv_cache_gib(flash, 3072, 128) == terms.rollout_kv_cache_bytes(flash.compress_ratios, 3072, 128) / GIB
    v41 = sizes("v41_flash")  # only its Full layers own compressed KV; read as V4 (every layer) it is larger
    assert kv_cache_gib(v41, 65536, 1) < 0.5 * terms.rollout_kv_cache_bytes(v41.compress_ratios, 65536, 1) / GIB


def test_a_kv_cache_that_does_not_fit_is_refused_and_each_lever_fits():
    base = ["ds4.max_seq_len=65536", "ds4.mesh.cp=8"]  # 128 sequences of 64k tokens per engine: 31.9 GiB beside 66.2 GiB
    refused = _report("grpo", base)
    [kv] = [e for e in refused.errors if e.setting == "rollout KV cache"]
    assert "128 sequences of 65,536 tokens" in kv.message and "31.9 GiB per GPU" in kv.message, kv.message
    assert refused.memory.rollout["kv_cache_gib"] == pytest.approx(31.9, abs=0.05)
    levers = dict(re.findall(r"(actor_rollout_ref\.rollout\.max_num_seqs|ds4\.rollout\.quantization|"
                             r"ds4\.rollout\.gpu_memory_utilization|ds4\.max_seq_len)=([^\s;]+)", kv.fix))
    assert set(levers) == {"actor_rollout_ref.rollout.max_num_seqs", "ds4.rollout.quantization",
                           "ds4.rollout.gpu_memory_utilization", "ds4.max_seq_len"}, kv.fix
    for key, value in levers.items():
        fixed = _report("grpo", base + [f"{key}={value}"])
        assert not any(e.setting == "rollout KV cache" for e in fixed.errors), (key, [str(e) for e in fixed.errors])
    # negative control: one sequence more than the lever names does not fit
    more = int(levers["actor_rollout_ref.rollout.max_num_seqs"]) + 1
    assert any(e.setting == "rollout KV cache" for e in _report("grpo", base + [f"actor_rollout_ref.rollout.max_num_seqs={more}"]).errors)
    # and the recipe's own length fits: the check is about length x concurrency, not the mesh
    assert not any(e.setting == "rollout KV cache" for e in _report("grpo", ["ds4.mesh.cp=8"]).errors)


def test_plan_fit_counts_the_recipes_logits_kernel():
    from tests.test_memory_on_cpu import plan_fit

    args = ("--model", "flash", "--gpu", "GB300", "--gpus", "128", "--recipe", "grpo", "--tokens-per-gpu", "65536",
            "--max-seq-len", "131072", "--json", "--max", "40")
    _, fused = plan_fit(*args)
    _, unfused = plan_fit(*args, "--logits", "unfused")
    assert fused["logits"] == "fused" and unfused["logits"] == "unfused"
    peaks = lambda r: {(m["pp"], m["ep"]): m["roles"]["actor"]["logits_gib"] for m in r["meshes"] + r["not_fitting"]}  # noqa: E731
    both = peaks(fused).keys() & peaks(unfused).keys()
    assert both and all(peaks(unfused)[k] > 10 * peaks(fused)[k] for k in both)
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):  # negative control: MTP (sft) has no fused kernel in verl
        rc, _ = plan_fit("--model", "flash", "--gpu", "GB300", "--gpus", "128", "--recipe", "sft", "--logits", "fused")
    assert rc != 0 and "--logits fused with MTP on" in err.getvalue()


def test_plan_fit_rollout_holds_one_longest_sequence_and_says_how_many():
    """plan --fit's rollout column: the smallest TP / weights whose weights and one longest sequence's KV cache fit
    vLLM's share, with how many such sequences an engine holds. Control: a share that holds the bf16 weights but not
    one sequence beside them moves to FP8 (the weights-only rule would have kept bf16)."""
    from verl_ds4.memory.fit import find_meshes
    from verl_ds4.memory.stages import rollout_weights_gib

    flash, cap, seq = sizes("flash"), 139.8, 65536
    kw = dict(recipe="grpo", tokens_per_gpu=8192, max_seq_len=seq, path="linear", logits_kernel="fused", levers_for=0)
    rows = find_meshes(flash, cap, [64], **kw)
    kv = kv_cache_gib(flash, seq, 1)
    for row in rows:
        r = row.rollout
        assert (r.tp, r.weights, r.length) == (8, "bf16", seq) and r.kv_gib_per_sequence == pytest.approx(kv)
        assert r.weights_gib + r.sequences * kv <= 0.6 * cap < r.weights_gib + (r.sequences + 1) * kv
    bf16 = rollout_weights_gib(flash, 8, None)
    share = (bf16 + kv / 2) / cap  # the bf16 weights fit, one sequence beside them does not
    [tight, *_] = find_meshes(flash, cap, [64], rollout_share=share, **kw)
    assert (tight.rollout.tp, tight.rollout.weights) == (8, "fp8") and tight.rollout.sequences >= 1
    assert bf16 <= share * cap  # negative control: by weights alone bf16 would have been chosen
