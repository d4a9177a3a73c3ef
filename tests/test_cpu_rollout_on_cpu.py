"""The ``cpu_demo`` rollout (verl_ds4/rollout): registration, sampling, the server on the real DS4 proxy, weight sync.

Real parts: verl's rollout registries and ``RolloutConfig``/``TokenOutput``, the tiny DS4 proxy built by the
CPU engine's own model builder (Megatron-Core ``GPTModel`` + pure-PyTorch DS4 attention), verl-ds4's THD
forward, and Ray (one test starts a real replica and its server actor). The only stand-in is a recording
object in place of a Ray actor handle in the adapter unit test (the Ray test covers the real handle).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import verl_ds4.rollout as cpu_rollout
from verl_ds4.rollout.cpu import CPURolloutServer, CPUServerAdapter, refuse_cuda, sample_next_token

REPO = Path(__file__).resolve().parents[1]


def _rollout_config(**overrides):
    from verl.workers.config import RolloutConfig

    kwargs = dict(name="cpu_demo", prompt_length=24, response_length=8, tensor_model_parallel_size=1)
    kwargs.update(overrides)
    return RolloutConfig(**kwargs)


# ------------------------------------------------------------------------------------------------
# registration
# ------------------------------------------------------------------------------------------------


def test_both_registries_resolve_the_name():
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import RolloutReplica, get_rollout_replica_class

    from verl_ds4.rollout.cpu import CPURolloutReplica

    assert cpu_rollout.is_registered()
    assert get_rollout_class("cpu_demo", "async") is CPUServerAdapter
    replica_cls = get_rollout_replica_class("cpu_demo")
    assert replica_cls is CPURolloutReplica and issubclass(replica_cls, RolloutReplica)
    cpu_rollout.register()  # idempotent
    assert cpu_rollout.is_registered()


def test_registration_refuses_to_replace_another_rollout(monkeypatch):
    from verl.workers.rollout import base

    monkeypatch.setitem(base._ROLLOUT_REGISTRY, ("cpu_demo", "async"), "somebody.else.Adapter")
    with pytest.raises(RuntimeError, match="will not replace"):
        cpu_rollout.register()


def test_import_verl_with_external_modules_registers_in_a_fresh_process():
    code = (
        "import verl\n"
        "from verl.workers.rollout.base import get_rollout_class\n"
        "from verl.workers.rollout.replica import get_rollout_replica_class\n"
        "print(get_rollout_class('cpu_demo').__name__, get_rollout_replica_class('cpu_demo').__name__)\n"
    )
    env = dict(os.environ, VERL_USE_EXTERNAL_MODULES="verl_ds4.rollout")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["CPUServerAdapter", "CPURolloutReplica"]


# ------------------------------------------------------------------------------------------------
# refusing CUDA, sampling
# ------------------------------------------------------------------------------------------------


def test_refuses_to_run_where_cuda_devices_are_visible(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    with pytest.raises(RuntimeError, match="rollout.name=vllm"):
        refuse_cuda("test")
    with pytest.raises(RuntimeError, match="CPU test/demo rollout"):
        CPURolloutServer(_rollout_config(), SimpleNamespace(hf_config=None), policy=object())


def test_sampling_greedy_top_k_top_p_and_seeded():
    logits = torch.tensor([0.5, 2.0, 1.0, -1.0])
    gen = torch.Generator().manual_seed(0)
    token, logprob = sample_next_token(logits, 0.0, -1, 1.0, gen)
    assert token == 1 and logprob == pytest.approx(float(torch.log_softmax(logits, -1)[1]))
    # top_k=1 and a tiny top_p both leave only the argmax
    assert {sample_next_token(logits, 1.0, 1, 1.0, gen)[0] for _ in range(20)} == {1}
    assert {sample_next_token(logits, 1.0, -1, 0.01, gen)[0] for _ in range(20)} == {1}
    # top_k=2 never samples outside the two largest; log-prob is the temperature-scaled one before the cut
    seen = {sample_next_token(logits, 2.0, 2, 1.0, gen)[0] for _ in range(200)}
    assert seen == {1, 2}
    token, logprob = sample_next_token(logits, 2.0, 2, 1.0, torch.Generator().manual_seed(3))
    assert logprob == pytest.approx(float(torch.log_softmax(logits / 2.0, -1)[token]))
    # frequencies follow the distribution; same seed, same draws
    draws = [sample_next_token(logits, 1.0, -1, 1.0, torch.Generator().manual_seed(s))[0] for s in range(3000)]
    freq = torch.bincount(torch.tensor(draws), minlength=4).double() / len(draws)
    assert torch.allclose(freq, torch.softmax(logits.double(), -1), atol=0.03)
    a = [sample_next_token(logits, 1.0, -1, 1.0, g)[0] for g in [torch.Generator().manual_seed(7)] * 10]
    b = [sample_next_token(logits, 1.0, -1, 1.0, g)[0] for g in [torch.Generator().manual_seed(7)] * 10]
    assert a == b


class _UniformPolicy:
    """Equal logits over 1000 tokens: what is sampled depends on the request's generator only."""

    def next_token_logits(self, token_ids):
        return torch.zeros(1000)

    def next_token_logits_batch(self, sequences):  # the batched server's call
        return torch.zeros(len(sequences), 1000)


def _fresh_server(global_steps, seed=42):
    server = CPURolloutServer(
        _rollout_config(seed=seed), SimpleNamespace(hf_config=None, tokenizer=None, generation_config=None),
        policy=_UniformPolicy(),
    )
    server.global_steps = global_steps  # what the trainer's weight sync sets (update_weights(global_steps=...))
    return server


def _sample(server, request_id):
    return asyncio.run(server.generate([5, 6, 7], {"temperature": 1.0, "max_tokens": 8}, request_id=request_id)).token_ids


def test_sampling_is_a_function_of_seed_step_and_request_id_not_of_the_process(caplog):
    """A resumed run's fresh server samples step N as the uninterrupted run's long-lived server did."""
    from verl_ds4.rollout.cpu import request_seed

    assert request_seed(42, 2, "det-0") == request_seed(42, 2, "det-0")
    assert len({request_seed(42, 2, "det-0"), request_seed(42, 3, "det-0"), request_seed(42, 2, "det-1"),
                request_seed(43, 2, "det-0"), request_seed(42, None, "det-0")}) == 5
    long_lived = _fresh_server(2)
    _sample(long_lived, "det-5")  # earlier requests in the same process change nothing
    first = _sample(long_lived, "det-0")
    assert _sample(_fresh_server(2), "det-0") == first  # a restarted process at the same step
    # Negative controls: another step, another index, another rollout seed sample differently.
    assert _sample(_fresh_server(3), "det-0") != first
    assert _sample(_fresh_server(2), "det-1") != first
    assert _sample(_fresh_server(2, seed=7), "det-0") != first
    # Random request ids (full_determinism=false) are named once, with the fix.
    with caplog.at_level("WARNING", logger="verl_ds4.rollout.cpu"):
        server = _fresh_server(2)
        _sample(server, "0f3a9c")
        _sample(server, "77aa01")
    warnings = [r.getMessage() for r in caplog.records if "not reproducible" in r.getMessage()]
    assert len(warnings) == 1 and "full_determinism=true" in warnings[0]


def test_a_seeded_rollout_refuses_the_agent_loop_that_names_every_request_det_0():
    """verl's single_turn_agent in the v1 trainer gets no priority: every request is "det-0", one seed for all."""
    from verl_ds4.rollout.cpu import check_request_ids

    with pytest.raises(ValueError, match="default_agent_loop=ds4_seeded_single_turn"):
        check_request_ids(_rollout_config(full_determinism=True))  # verl's default agent loop
    with pytest.raises(ValueError, match="every advantage 0"):
        CPURolloutServer(_rollout_config(full_determinism=True), SimpleNamespace(
            hf_config=None, tokenizer=None, generation_config=None), policy=_UniformPolicy())  # at start-up
    # Controls: the seeded agent loop, or random ids (full_determinism=false), start.
    from verl.workers.config.rollout import AgentLoopConfig

    seeded = AgentLoopConfig(default_agent_loop="ds4_seeded_single_turn")
    check_request_ids(_rollout_config(full_determinism=True, agent=seeded))
    check_request_ids(_rollout_config(full_determinism=False))


def test_the_seeded_agent_loop_gives_every_response_of_a_step_its_own_request_id(monkeypatch):
    """Each (row, response) pair gets its own priority, so its own "det-<n>" id and seed; verl's loop gives 0."""
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

    from verl_ds4.rollout import SEEDED_AGENT_LOOP
    from verl_ds4.rollout.agent_loop import SeededSingleTurnAgentLoop, request_priority

    assert _agent_loop_registry[SEEDED_AGENT_LOOP]["_target_"] == "verl_ds4.rollout.agent_loop.SeededSingleTurnAgentLoop"
    seen = []

    async def recording_run(self, sampling_params, priority=0, **kwargs):  # verl's run: request_id = f"det-{priority}"
        seen.append(priority)

    monkeypatch.setattr(SingleTurnAgentLoop, "run", recording_run)
    loop = object.__new__(SeededSingleTurnAgentLoop)
    loop.rollout_config = SimpleNamespace(n=4, val_kwargs=SimpleNamespace(n=1))
    rows = [{"index": i} for i in (17, 3, 250, 0)]  # a step's prompts (shuffled dataset rows)

    async def step(agent):  # what verl's v1 agent loop calls: run(sampling_params, session_id=i, **prompt), no priority
        for extra_info in rows:
            for session in range(4):
                await agent.run({}, session_id=session, extra_info=extra_info, raw_prompt=[])

    asyncio.run(step(loop))
    assert len(seen) == 16 and len(set(seen)) == 16, seen  # 16 responses, 16 ids
    assert seen[:4] == [68, 69, 70, 71]  # row 17's group: 17 * 4 + session; the same in a resumed run
    # Negative control: verl's own loop, called the same way, leaves every request at priority 0 ("det-0").
    seen.clear()
    plain = object.__new__(SingleTurnAgentLoop)
    asyncio.run(step(plain))
    assert set(seen) == {0}
    # A row without an integer extra_info.index is refused (every row would share one id).
    for bad in ({}, {"index": "7"}, {"index": True}, None):
        with pytest.raises(ValueError, match="expected the row's integer index"):
            request_priority(bad, 0, 4)
    with pytest.raises(ValueError, match="session_id=4 in"):
        request_priority({"index": 1}, 4, 4)


# ------------------------------------------------------------------------------------------------
# the server on the real DS4 proxy (one forked gloo process: Megatron needs a process group)
# ------------------------------------------------------------------------------------------------


def _proxy_hf_config():
    from verl_ds4.cpu.sft_data import model_hf_config

    return model_hf_config("ds4_proxy")  # vocabulary sized to the demo tokenizer


def _server_checks(rank: int, world: int) -> dict:
    import logging

    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    from verl_ds4.models.ds4.proxy import reset_parameters
    from verl_ds4.rollout.policy import MegatronCPUPolicy

    hf_config = _proxy_hf_config()
    policy = MegatronCPUPolicy(hf_config)
    model_config = SimpleNamespace(hf_config=hf_config, tokenizer=None, generation_config=None)
    server = CPURolloutServer(_rollout_config(), model_config, policy=policy)
    # The demo vocabulary has a real EOS id; these checks count tokens, so no EOS until part 2 sets one.
    server.eos_token_ids = set()
    out: dict = {}
    prompt = [5, 17, 3, 42, 8, 8, 21, 9, 60, 2]

    # 1. sampled tokens carry the log-probs a single full-sequence forward of the same weights gives
    #    (what the actor recomputes as old log-probs)
    res = asyncio.run(server.generate(prompt, {"temperature": 1.0, "logprobs": True}, request_id="r1"))
    out["n_tokens"] = len(res.token_ids)
    from verl_ds4.mcore.model_forward import gptmodel_forward_model_engine

    seq = prompt + res.token_ids
    nested = torch.nested.nested_tensor_from_jagged(torch.tensor(seq), offsets=torch.tensor([0, len(seq)]))
    with torch.no_grad():
        logits = gptmodel_forward_model_engine(policy.model, nested, {}).values().float()
    full = torch.log_softmax(logits[len(prompt) - 1 : -1], -1).gather(-1, torch.tensor(res.token_ids)[:, None])[:, 0]
    out["logprob_diff"] = (full - torch.tensor(res.log_probs)).abs().max().item()
    out["same_request_same_tokens"] = (
        asyncio.run(server.generate(prompt, {"temperature": 1.0}, request_id="r1")).token_ids == res.token_ids
    )
    out["no_logprobs_unless_asked"] = asyncio.run(server.generate(prompt, {"temperature": 0}, "r2")).log_probs is None

    # 1b. requests sent together are decoded together (one packed forward per token for all of them), and
    #     each gets what it gets alone: the same tokens, the same log-probs to float rounding
    prompts = [prompt, prompt[:4], [7, 7, 3, 9, 1, 4, 4, 2, 8, 5, 6, 1, 30, 31]]
    sampling = {"temperature": 1.0, "logprobs": True}
    start = server.num_forwards
    alone = [server.generate_sync(p, dict(sampling), f"b{i}") for i, p in enumerate(prompts)]
    out["serial_forwards"] = server.num_forwards - start

    async def together():
        return await asyncio.gather(*[server.generate(p, dict(sampling), f"b{i}") for i, p in enumerate(prompts)])

    start = server.num_forwards
    batched = asyncio.run(together())
    out["batched_forwards"] = server.num_forwards - start
    out["batched_max_active"] = server.max_active
    out["batched_same_tokens"] = [b.token_ids for b in batched] == [a.token_ids for a in alone]
    out["batched_logprob_diff"] = max(
        abs(x - y) for a, b in zip(alone, batched) for x, y in zip(a.log_probs, b.log_probs)
    )

    # 2. max_tokens and eos
    out["max_tokens_3"] = len(asyncio.run(server.generate(prompt, {"temperature": 0, "max_tokens": 3}, "r3")).token_ids)
    greedy = asyncio.run(server.generate(prompt, {"temperature": 0}, "r4")).token_ids
    server.eos_token_ids = {greedy[0]}
    out["eos_stops"] = asyncio.run(server.generate(prompt, {"temperature": 0}, "r5")).token_ids == greedy[:1]
    out["ignore_eos"] = asyncio.run(server.generate(prompt, {"temperature": 0, "ignore_eos": True}, "r6")).token_ids == greedy
    server.eos_token_ids = set()

    # 3. weight sync: the actor's Megatron names and tensors load exactly and change what is generated
    before = policy.next_token_logits(prompt).clone()
    actor = MegatronCPUPolicy(hf_config).model  # the same builder the CPU engine uses -> same names
    reset_parameters(actor, seed=999, std=0.3)
    exported = [(f"module.{name}", p.detach().clone()) for name, p in actor.named_parameters()]

    # a weight update sent while a request runs waits for it; a request sent after the update uses the new weights
    async def request_update_request():
        return await asyncio.gather(
            server.generate(prompt, {"temperature": 0}, "m1"),
            server.update_weights(exported, global_steps=3),
            server.generate(prompt, {"temperature": 0}, "m2"),
        )

    in_flight, loaded, queued_after = asyncio.run(request_update_request())
    new_greedy = asyncio.run(server.generate(prompt, {"temperature": 0}, "m3")).token_ids
    out["in_flight_keeps_old_weights"] = in_flight.token_ids == greedy
    out["queued_after_gets_new_weights"] = queued_after.token_ids == new_greedy and new_greedy != greedy
    params = dict(policy.model.named_parameters())
    out["all_loaded"] = loaded == len(params) and all(
        torch.equal(params[name[len("module.") :]], t) for name, t in exported
    )
    with torch.no_grad():
        expected = gptmodel_forward_model_engine(actor, torch.nested.nested_tensor_from_jagged(
            torch.tensor(prompt), offsets=torch.tensor([0, len(prompt)])), {}).values()[-1].float()
    after = policy.next_token_logits(prompt)
    out["logits_follow_weights"] = torch.allclose(after, expected, atol=1e-5) and not torch.allclose(after, before)
    out["global_steps"] = asyncio.run(server.generate(prompt, {"temperature": 0, "max_tokens": 1}, "r7")).extra_fields[
        "global_steps"
    ]

    # 4. the test-only switch (the mismatch gate's negative control) skips the sync of one global step only
    from verl_ds4.rollout.cpu import ENV_TEST_SKIP_SYNC

    halved = [(name, t * 0.5) for name, t in exported]
    os.environ[ENV_TEST_SKIP_SYNC] = "4"
    try:
        skipped = asyncio.run(server.update_weights(halved, global_steps=4))
        out["skip_loads_nothing"] = skipped == 0 and torch.equal(policy.next_token_logits(prompt), after)
        synced = asyncio.run(server.update_weights(halved, global_steps=5))
        out["skip_only_that_step"] = synced == len(params) and not torch.equal(policy.next_token_logits(prompt), after)
    finally:
        del os.environ[ENV_TEST_SKIP_SYNC]

    # 5. bad exports fail clearly
    errors = {}
    for label, bad in {
        "missing": exported[1:],
        "unexpected": exported + [("module.extra.weight", torch.zeros(1))],
        "shape": [(exported[0][0], torch.zeros(3))] + exported[1:],
    }.items():
        try:
            asyncio.run(server.update_weights(bad))
            errors[label] = None
        except ValueError as err:
            errors[label] = str(err)
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def server_results():
    from verl_ds4.mcore.distributed import run_distributed

    return run_distributed(_server_checks, world_size=1, timeout=240)[0]


def test_server_logprobs_match_a_full_forward_of_the_same_weights(server_results):
    assert server_results["n_tokens"] == 8  # response_length
    assert server_results["logprob_diff"] < 1e-4
    assert server_results["same_request_same_tokens"]
    assert server_results["no_logprobs_unless_asked"]


def test_server_decodes_concurrent_requests_together_with_the_same_results(server_results):
    assert server_results["serial_forwards"] == 3 * 8  # one request at a time: a forward per token each
    assert server_results["batched_forwards"] == 8  # together: one packed forward per token for all three
    assert server_results["batched_max_active"] == 3
    assert server_results["batched_same_tokens"]
    assert server_results["batched_logprob_diff"] < 1e-5


def test_weight_updates_wait_for_running_requests(server_results):
    assert server_results["in_flight_keeps_old_weights"]
    assert server_results["queued_after_gets_new_weights"]


def test_the_test_only_switch_skips_one_weight_sync(server_results):
    assert server_results["skip_loads_nothing"]
    assert server_results["skip_only_that_step"]


def test_server_honours_max_tokens_and_eos(server_results):
    assert server_results["max_tokens_3"] == 3
    assert server_results["eos_stops"]
    assert server_results["ignore_eos"]


def test_server_loads_actor_weights_every_update(server_results):
    assert server_results["all_loaded"]
    assert server_results["logits_follow_weights"]
    assert server_results["global_steps"] == 3


def test_server_rejects_mismatched_exports(server_results):
    errors = server_results["errors"]
    assert "missing" in errors["missing"] and "(1)" in errors["missing"]
    assert "unexpected ['module.extra.weight']" in errors["unexpected"]
    assert "shape (3,)" in errors["shape"]


# ------------------------------------------------------------------------------------------------
# the adapter (per actor rank)
# ------------------------------------------------------------------------------------------------


class _RecordingMethod:
    def __init__(self):
        self.calls = []

    def remote(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        future = asyncio.get_event_loop().create_future()
        future.set_result(len(args[0]))
        return future


def _adapter(monkeypatch, rank: int, tp: int = 1):
    monkeypatch.setenv("RANK", str(rank))
    adapter = CPUServerAdapter(_rollout_config(tensor_model_parallel_size=tp), SimpleNamespace(), device_mesh=None)
    handle = SimpleNamespace(update_weights=_RecordingMethod())
    adapter.server_handle = handle
    return adapter, handle


def test_adapter_rank0_sends_every_tensor_other_ranks_only_drain(monkeypatch):
    drained = []

    def export():
        for i in range(3):
            drained.append(i)
            yield f"w{i}", torch.full((2,), float(i))

    adapter, handle = _adapter(monkeypatch, rank=0)
    asyncio.run(adapter.update_weights(export(), global_steps=5))
    (args, kwargs), = handle.update_weights.calls
    assert [n for n, _ in args[0]] == ["w0", "w1", "w2"] and kwargs == {"global_steps": 5}
    assert torch.equal(args[0][2][1], torch.full((2,), 2.0))

    drained.clear()
    adapter, handle = _adapter(monkeypatch, rank=1)  # tp=1: rank 1 is replica 1's rank 0
    assert (adapter.replica_rank, adapter.rollout_rank) == (1, 0)
    adapter, handle = _adapter(monkeypatch, rank=3, tp=2)  # rank 1 of replica 1: drains, sends nothing
    assert (adapter.replica_rank, adapter.rollout_rank) == (1, 1)
    asyncio.run(adapter.update_weights(export()))
    assert drained == [0, 1, 2] and handle.update_weights.calls == []

    with pytest.raises(ValueError, match="checkpoint_engine.backend=naive"):
        asyncio.run(adapter.update_weights(export(), wire_format="delta_flush"))
    with pytest.raises(ValueError, match="LoRA"):
        asyncio.run(adapter.update_weights(export(), peft_config={"r": 8}))


# ------------------------------------------------------------------------------------------------
# one real Ray run: replica -> server actor -> generate, adapter -> weight update
# ------------------------------------------------------------------------------------------------


def test_replica_launches_a_ray_server_that_generates_and_takes_weights(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    from omegaconf import OmegaConf

    from verl_ds4.cpu.sft_data import write_model_dir

    model_dir = write_model_dir(tmp_path / "model", hf_config=_proxy_hf_config())
    model_config = OmegaConf.create(
        {"_target_": "verl.workers.config.HFModelConfig", "path": str(model_dir), "trust_remote_code": False}
    )
    env = {"VERL_USE_EXTERNAL_MODULES": "verl_ds4.rollout", "OMP_NUM_THREADS": "1"}
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env}, log_to_driver=False)
    try:
        from verl.workers.rollout.replica import get_rollout_replica_class

        replica = get_rollout_replica_class("cpu_demo")(
            replica_rank=0, config=_rollout_config(), model_config=model_config, gpus_per_node=1
        )
        asyncio.run(replica.launch_servers())
        server = replica.server_handle
        assert replica.server_address == "cpu_demo-replica-0"
        out = ray.get(server.generate.remote(prompt_ids=[5, 6, 7], sampling_params={"temperature": 0}, request_id="a"))
        assert 1 <= len(out.token_ids) <= 8 and all(0 <= t < 97 for t in out.token_ids)
        for method in ("wake_up", "sleep", "resume_generation", "clear_kv_cache", "release_kv_cache",
                       "resume_kv_cache", "stop_profile"):  # fmt: skip
            ray.get(getattr(server, method).remote())
        assert ray.get(server.abort_all_requests.remote())["aborted_count"] == 0
        asyncio.run(replica.wake_up())
        asyncio.run(replica.sleep())

        # the adapter finds the server by name and pushes a full export (here: the server's own names)
        names = ray.get(server.__ray_call__.remote(lambda self: self.policy.parameter_names()))
        monkeypatch.setenv("RANK", "0")
        adapter = CPUServerAdapter(_rollout_config(), SimpleNamespace(), device_mesh=None)
        shapes = ray.get(server.__ray_call__.remote(
            lambda self: {n: tuple(p.shape) for n, p in self.policy.model.named_parameters()}))  # fmt: skip
        zeros = ((n, torch.zeros(shapes[n])) for n in names)
        asyncio.run(adapter.update_weights(zeros, global_steps=1))
        stats = ray.get(server.get_stats.remote())
        assert stats == {"num_weight_updates": 1, "global_steps": 1, "replica_rank": 0}
        # all-zero weights: every logit is 0, greedy picks token 0 every step
        out = ray.get(server.generate.remote(prompt_ids=[5, 6, 7], sampling_params={"temperature": 0}, request_id="b"))
        assert set(out.token_ids) == {0} and out.extra_fields["global_steps"] == 1
    finally:
        ray.shutdown()


# ------------------------------------------------------------------------------------------------
# the CPU engine's weight export (what the trainer hands the adapter every step)
# ------------------------------------------------------------------------------------------------


def test_cpu_weight_export_unwraps_names_and_steps_aside_for_an_engine_export(monkeypatch):
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    from verl_ds4.cpu import engine as cpu_engine
    from verl_ds4.rollout import cpu_weight_export

    class Wrapper(torch.nn.Module):  # like Megatron's DDP / Float16Module: the model sits in .module
        def __init__(self, inner):
            super().__init__()
            self.module = inner

    inner = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    exported = dict(cpu_weight_export.megatron_named_tensors([Wrapper(inner)]))
    assert sorted(exported) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert torch.equal(exported["1.weight"], inner[1].weight)
    with pytest.raises(ValueError, match="one model chunk"):
        list(cpu_weight_export.megatron_named_tensors([inner, inner]))

    lm, vh = cpu_engine.CPUMegatronEngineWithLMHead, cpu_engine.CPUMegatronEngineWithValueHead
    # an engine without its own export gets this one ...
    monkeypatch.setattr(lm, "get_per_tensor_param", MegatronEngine.get_per_tensor_param)
    monkeypatch.setattr(vh, "get_per_tensor_param", MegatronEngine.get_per_tensor_param)
    assert len(cpu_weight_export.install()) == 2
    assert lm.get_per_tensor_param is cpu_weight_export._get_per_tensor_param
    # ... an engine that defines one keeps it
    own = lambda self, **kw: (iter(()), None)  # noqa: E731
    monkeypatch.setattr(lm, "get_per_tensor_param", own)
    monkeypatch.setattr(vh, "get_per_tensor_param", own)
    assert cpu_weight_export.install() == []
    assert lm.get_per_tensor_param is own


def test_cpu_weight_export_can_be_taken_back():
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    from verl_ds4.cpu import engine as cpu_engine
    from verl_ds4.rollout import cpu_weight_export

    lm = cpu_engine.CPUMegatronEngineWithLMHead
    before = lm.__dict__.get("get_per_tensor_param")
    cpu_weight_export.uninstall()
    assert "get_per_tensor_param" not in lm.__dict__  # verl's export answers again
    assert lm.get_per_tensor_param is MegatronEngine.get_per_tensor_param
    assert len(cpu_weight_export.install()) == 2  # negative control: installed, it answers instead
    assert lm.get_per_tensor_param is cpu_weight_export._get_per_tensor_param
    assert len(cpu_weight_export.uninstall()) == 2 and cpu_weight_export.uninstall() == []
    if before is not None:  # leave the class as this process had it
        cpu_weight_export.install()


# ------------------------------------------------------------------------------------------------
# the task's assets (scripts/run_ds4_proxy_ppo_cpu.sh runs demo_task.py as a script)
# ------------------------------------------------------------------------------------------------


def test_task_assets_are_reused_for_the_same_arguments_and_rewritten_otherwise(tmp_path):
    import pandas as pd

    from verl_ds4.rollout.demo_task import write_ppo_assets

    first = write_ppo_assets(tmp_path, n_train=8, n_val=2, model="ds4_proxy")
    train = Path(first["train"])
    stamp = train.stat().st_mtime_ns
    assert write_ppo_assets(tmp_path, n_train=8, n_val=2, model="ds4_proxy") == first
    assert train.stat().st_mtime_ns == stamp  # reused, not rewritten
    # negative controls: other arguments, or a record left by an interrupted write, rewrite the folder
    write_ppo_assets(tmp_path, n_train=12, n_val=2, model="ds4_proxy")
    assert len(pd.read_parquet(train)) == 12
    (tmp_path / "assets.json").write_text('{"model": "ds4_proxy", "n_train": 12, "n_val": 2, "seed": 0}\n')
    train.unlink()
    write_ppo_assets(tmp_path, n_train=12, n_val=2, model="ds4_proxy")
    assert len(pd.read_parquet(train)) == 12


def test_a_reused_task_folder_costs_the_launcher_no_heavy_import(tmp_path):
    """The launcher runs demo_task.py as a script: for a folder it can reuse, nothing heavy is imported."""
    from verl_ds4.rollout.demo_task import write_ppo_assets

    write_ppo_assets(tmp_path, n_train=4, n_val=2, model="ds4_proxy")
    task = REPO / "verl_ds4" / "rollout" / "demo_task.py"
    code = (f"import runpy, sys\n"
            f"sys.argv = ['demo_task.py', '--out', {str(tmp_path)!r}, '--n-train', '4', '--n-val', '2', '--model', 'ds4_proxy']\n"
            f"try:\n    runpy.run_path({str(task)!r}, run_name='__main__')\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
            f"print(sorted(m for m in ('verl', 'torch', 'megatron') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-1] == "[]", out.stdout
    assert f"train: {tmp_path / 'data' / 'train.parquet'}" in out.stdout
