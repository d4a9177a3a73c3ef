"""The CPU pieces under the CPU main job, each on its own (fast; no torchrun).

* the verl platform ``cpu`` and its process-group initialisers, and that nothing changes
  without ``VERL_PLATFORM=cpu``;
* the CPU engine's helpers: CUDA-literal redirection, the CPU RNG tracker, Adam ``step``
  restore after a checkpoint load, CPU transformer settings, engine registration;
* the tiny dense THD attention: CP=2 over gloo equals CP=1 (outputs and gradients).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from verl_ds4.mcore.distributed import run_distributed


def _python(code: str, **env_updates) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_PLATFORM", "VERL_USE_EXTERNAL_MODULES")}
    env.update(env_updates)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=180
    )


def test_cpu_platform_selected_by_env_and_effective_in_verl():
    result = _python(
        """
        import verl
        import verl.utils.distributed as d
        from verl.utils.device import get_device_name, get_nccl_backend, get_torch_device, get_device_id
        from verl_ds4.cpu.platform import self_check, initialize_global_process_group_cpu
        self_check()
        assert get_device_name() == "cpu" and get_nccl_backend() == "gloo" and get_device_id() == "cpu"
        mod = get_torch_device()
        assert mod.device_count() == 0 and mod.max_memory_allocated() == 0 and mod.empty_cache() is None
        assert d.initialize_global_process_group is initialize_global_process_group_cpu
        print("OK")
        """,
        VERL_PLATFORM="cpu",
        VERL_USE_EXTERNAL_MODULES="verl_ds4.cpu.platform",
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


def test_without_verl_platform_cpu_nothing_changes():
    result = _python(
        """
        import verl
        import verl.utils.distributed as d
        original = d.initialize_global_process_group
        from verl.plugin.platform import PlatformRegistry
        import verl_ds4.cpu.platform as cpu
        assert cpu.install() is False
        assert d.initialize_global_process_group is original      # verl's own, untouched
        assert PlatformRegistry.get("cpu") is cpu.PlatformCPU     # registered, but
        assert not cpu.PlatformCPU().is_platform_available(use_smi_check=True)  # never auto-detected
        try:
            cpu.self_check()
        except RuntimeError as e:
            assert "not selected" in str(e)
        else:
            raise AssertionError("self_check must fail without VERL_PLATFORM=cpu")
        print("OK")
        """
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


def test_cpu_platform_install_is_reversible():
    """uninstall() gives verl its own process-group initialisers back (the same objects), repeatedly."""
    result = _python(
        """
        import verl
        import verl.utils.distributed as d
        import verl_ds4.cpu.platform as cpu
        assert cpu.installed()  # installed at import (VERL_PLATFORM=cpu)
        original = cpu._ORIGINALS[("verl.utils.distributed", "initialize_global_process_group")]
        assert original.__module__ == "verl.utils.distributed" and original is not d.initialize_global_process_group
        original_ray = cpu._ORIGINALS[("verl.utils.distributed", "initialize_global_process_group_ray")]
        for _ in range(2):
            assert cpu.install() and cpu.install()  # idempotent: the originals are kept once
            assert cpu.uninstall() and not cpu.uninstall()
            assert d.initialize_global_process_group is original and not cpu.installed()
            assert d.initialize_global_process_group_ray is original_ray
            assert cpu.install() and cpu.installed()
        import verl.workers.engine_workers as w  # binds `from verl.utils.distributed import ...`: ours now
        assert w.initialize_global_process_group_ray is cpu.initialize_global_process_group_ray_cpu
        assert cpu.uninstall()
        assert w.initialize_global_process_group_ray is original_ray  # that binding is restored too
        print("OK")
        """,
        VERL_PLATFORM="cpu",
        VERL_USE_EXTERNAL_MODULES="verl_ds4.cpu.platform",
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


def _init_pg_rank(rank, world_size):
    from verl_ds4.cpu.platform import initialize_global_process_group_cpu

    # run_distributed already initialised gloo: the CPU twin must accept that and report the env ranks.
    return initialize_global_process_group_cpu(), torch.distributed.get_backend()


def test_cpu_process_group_initialiser_uses_gloo():
    results = run_distributed(_init_pg_rank, world_size=2)
    assert results == [((0, 0, 2), "gloo"), ((1, 1, 2), "gloo")]


def test_cuda_literals_redirected_only_inside_the_scope():
    from verl_ds4.substitutes.cuda_literals import cuda_literals_on_cpu

    current_device = torch.cuda.current_device
    with cuda_literals_on_cpu(report_cuda_types=True):
        a = torch.zeros([], dtype=torch.int, device="cuda")
        b = torch.empty(3, device=torch.cuda.current_device())
        c = torch.ones(2).cuda()
        assert {a.device.type, b.device.type, c.device.type} == {"cpu"}
        assert c.type() == "torch.cuda.FloatTensor"
    assert torch.cuda.current_device is current_device
    assert torch.ones(2).type() == "torch.FloatTensor"
    if not torch.cuda.is_available():
        with pytest.raises((RuntimeError, AssertionError)):
            torch.zeros(1, device="cuda")


def test_cpu_rng_tracker_forks_and_round_trips():
    from verl_ds4.cpu.rng import CPURNGStatesTracker

    tracker = CPURNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    torch.manual_seed(0)
    outer_before = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), outer_before)  # the outer stream is untouched
    saved = tracker.get_states()
    with tracker.fork():
        second = torch.rand(4)
    assert torch.equal(first, torch.rand(4, generator=torch.Generator().manual_seed(1234)))  # seeded stream
    assert not torch.equal(first, second)  # the tracked stream advanced
    tracker.set_states(saved)
    with tracker.fork():
        assert torch.equal(torch.rand(4), second)  # restoring states replays the stream
    with pytest.raises(ValueError):
        tracker.add("other", 1234)


def test_adam_step_counters_restored_from_loaded_param_groups():
    from verl_ds4.cpu.optimizer_state import restore_adam_step_counters as _restore_adam_step_counters

    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    inner = torch.optim.AdamW(params, lr=0.1)
    shared = torch.tensor(0.0)  # what Megatron's load leaves: one placeholder tensor for all params
    for p in params:
        inner.state[p].update(step=shared, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
    inner.param_groups[0]["step"] = 7.0

    class Wrapper:  # Megatron optimizers expose the torch optimizer as `.optimizer`
        optimizer = inner

    _restore_adam_step_counters(Wrapper())
    steps = [inner.state[p]["step"] for p in params]
    assert [float(s) for s in steps] == [7.0, 7.0]
    assert steps[0] is not steps[1] and steps[0] is not shared
    for p in params:
        p.grad = torch.ones_like(p)
    inner.step()
    assert [float(inner.state[p]["step"]) for p in params] == [8.0, 8.0]


def test_cpu_transformer_overrides_reject_contradicting_user_values():
    from verl_ds4.cpu.builders import cpu_transformer_overrides

    merged = cpu_transformer_overrides({"recompute_granularity": None})
    assert merged["use_cpu_initialization"] is True and merged["gradient_accumulation_fusion"] is False
    assert merged["recompute_granularity"] is None
    with pytest.raises(ValueError, match="use_cpu_initialization"):
        cpu_transformer_overrides({"use_cpu_initialization": False})


def test_cpu_engine_config_adds_fp32_and_keeps_verls_checks():
    from verl.workers.config import McoreEngineConfig

    from verl_ds4.cpu.engine import CPUMcoreEngineConfig

    with pytest.raises(AssertionError, match="float32"):  # verl 0.9.1's own config: half precision only
        McoreEngineConfig(dtype="float32")
    config = CPUMcoreEngineConfig(dtype="float32", tensor_model_parallel_size=1, sequence_parallel=True)
    assert config.dtype == "float32"
    assert config.sequence_parallel is False  # verl's TP=1 rule still ran
    assert CPUMcoreEngineConfig(dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(AssertionError, match="float64"):
        CPUMcoreEngineConfig(dtype="float64")
    with pytest.raises(ValueError, match="max_seqlen_per_dp_cp_rank"):
        CPUMcoreEngineConfig(dtype="float32", dynamic_context_parallel=True)


def test_fp32_params_refused_by_the_gpu_engines_accepted_by_the_cpu_engines():
    from types import SimpleNamespace

    from verl_ds4.cpu.engine import CPUMcoreEngineConfig, CPUMegatronEngineWithLMHead, CPUMegatronEngineWithValueHead
    from verl_ds4.engine.megatron import DS4MegatronEngineWithLMHead, DS4MegatronEngineWithValueHead

    model_config = SimpleNamespace(hf_config=SimpleNamespace(model_type="llama"))
    fp32 = CPUMcoreEngineConfig(dtype="float32")
    for gpu_engine in (DS4MegatronEngineWithLMHead, DS4MegatronEngineWithValueHead):
        with pytest.raises(ValueError, match="engine.dtype=bfloat16"):
            gpu_engine._check_startup_settings(object.__new__(gpu_engine), model_config, fp32)
    for cpu_engine in (CPUMegatronEngineWithLMHead, CPUMegatronEngineWithValueHead):
        cpu_engine._check_startup_settings(object.__new__(cpu_engine), model_config, fp32)


def test_register_cpu_engines_adds_cpu_keys_only():
    from verl.workers.engine.base import EngineRegistry

    from verl_ds4.cpu import engine as cpu

    cpu.register_cpu_engines()
    cpu.register_cpu_engines()  # idempotent
    lm = EngineRegistry._engines["language_model"]["megatron"]
    value = EngineRegistry._engines["value_model"]["megatron"]
    assert lm["cpu"] is cpu.CPUMegatronEngineWithLMHead
    assert value["cpu"] is cpu.CPUMegatronEngineWithValueHead
    assert lm.get("cuda") is not cpu.CPUMegatronEngineWithLMHead


def _tiny_attention_rank(rank, world_size, q, k, v, cu_padded):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from verl_ds4.cpu.tiny_dense import TorchTHDCausalAttention

    config = TransformerConfig(
        num_layers=1, hidden_size=q.shape[1] * q.shape[2], num_attention_heads=q.shape[1],
        num_query_groups=k.shape[1], attention_dropout=0.0, use_cpu_initialization=True,
    )
    group = torch.distributed.new_group(list(range(world_size)))

    class PG:
        cp = group

    attn = TorchTHDCausalAttention(config, 1, AttnMaskType.causal, "self", pg_collection=PG(), rope_theta=100.0)
    rows = q.shape[0] // world_size
    local = slice(rank * rows, (rank + 1) * rows)
    ql, kl, vl = (t[local].clone().requires_grad_(True) for t in (q, k, v))
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_padded, cu_seqlens_kv=cu_padded,
        cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=int(cu_padded.diff().max()), max_seqlen_kv=int(cu_padded.diff().max()),
    )
    params.cp_partition_mode = "contiguous"  # as verl_ds4.mcore.thd records it
    out = attn(ql, kl, vl, None, packed_seq_params=params)
    weight = torch.arange(q.shape[0] * out.shape[1], dtype=out.dtype).reshape(q.shape[0], -1).sin()[local]
    (out * weight).sum().backward()
    # numpy: pickled by value (tensors would travel as shared-memory handles of an exiting process)
    return tuple(t.detach().numpy() for t in (out, ql.grad, kl.grad, vl.grad))


def test_tiny_dense_attention_cp2_equals_cp1():
    torch.manual_seed(0)
    cu_padded = torch.tensor([0, 5, 17, 18, 32], dtype=torch.int32)  # ragged, one sequence straddles ranks
    q = torch.randn(32, 4, 8, dtype=torch.float64)
    k = torch.randn(32, 2, 8, dtype=torch.float64)
    v = torch.randn(32, 2, 8, dtype=torch.float64)
    full = run_distributed(_tiny_attention_rank, world_size=1, args=(q, k, v, cu_padded))[0]
    split = run_distributed(_tiny_attention_rank, world_size=2, args=(q, k, v, cu_padded))
    for index in range(4):
        joined = torch.cat([torch.from_numpy(split[0][index]), torch.from_numpy(split[1][index])])
        torch.testing.assert_close(joined, torch.from_numpy(full[index]), rtol=1e-12, atol=1e-12)
