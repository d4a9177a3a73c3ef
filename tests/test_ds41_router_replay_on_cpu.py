"""verl's router replay (R2 / R3) on the tiny DeepSeek-V4.1, built by the CPU ``deepseek_v41`` builder.

V4.1's MoE is V4's ``DS4MoE`` / ``DS4Router`` on every layer. V4.1 has no ``hash_moe`` layers (score
routers only; NeMo Automodel's ``deepseek_v41`` has no ``tid2eid``): its hashing is Engram's n-gram
tables, which are not routers, so the Engram layers (1 and 3) are checked like every other layer and
perturbed in a negative control of their own. On real gloo ranks, model from the CPU jobs' V4.1 folder
through ``DS41_CPU_BUILDER`` with the flag verl's engine sets for ``router_replay.mode`` R2 / R3:

* the builder gives all 8 routers a verl ``RouterReplay`` and layer numbers 1..8 (verl's own
  ``iter_model_routers`` finds them); without the flag none (the control);
* RECORD at CP=1 and CP=2: the per-layer ``[rows, topk]`` routes, unpacked with each micro-batch's THD
  plan, are identical, and recording leaves the logits unchanged;
* REPLAY_FORWARD at CP=2 of CP=1's routes, packed with CP=2's plan: the logits equal the native forward's;
  negative controls: routes shifted by one expert on an Engram layer or on a plain layer change the
  logits; routes not packed with the plan (wrong row count) are refused;
* verl's ``merge_router_topk_indices`` / ``set_router_replay_data(model=...)`` (its R3 path, with
  verl-ds4's hooks and the resolved layout) at CP 1 and 2: merged routes equal the plan's, replay
  reproduces the logits, shifted routes do not.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl_ds4.mcore.distributed import run_distributed

LENGTHS = (5, 41, 63, 23)


def _build(folder: str, replay: bool, world: int):
    """The actor model as verl's CPU engine builds it: builder config (+ the engine's replay flag), builder build."""
    from transformers import AutoConfig

    from verl_ds4.cpu.builders import cpu_transformer_overrides
    from verl_ds4.cpu.ds41_builder import DS41_CPU_BUILDER

    hf = AutoConfig.from_pretrained(folder)  # the builder's import registered deepseek_v41
    config = DS41_CPU_BUILDER.transformer_config(hf, torch.float64, cpu_transformer_overrides({}))
    assert config.context_parallel_size == world
    if replay:  # what verl's engine sets for router_replay.mode != disabled (verl_ds4/cpu/engine.py)
        setattr(config, "moe_enable_routing_replay" if hasattr(config, "moe_enable_routing_replay") else "enable_routing_replay", True)
    model = DS41_CPU_BUILDER.build(config, hf, pre_process=True, post_process=True, share_embeddings=False).eval()
    with torch.no_grad():  # a bias that moves the choice, so the bias path is replayed too (the folder's is 0)
        gen = torch.Generator().manual_seed(8)
        for name, buf in model.named_buffers():
            if name.endswith("expert_bias"):
                buf.copy_(0.05 * torch.randn(buf.shape, generator=gen, dtype=torch.float64))
    return model


def _batch(vocab: int):
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, vocab, (sum(LENGTHS),), generator=gen)
    return torch.nested.nested_tensor_from_jagged(ids, offsets=torch.tensor([0, *LENGTHS]).cumsum(0))


def _replay_worker(rank: int, world: int, folder: str, replay_routes):
    import logging

    from megatron.core import parallel_state
    from verl.utils.megatron.router_replay_patch import RouterReplay, RouterReplayAction
    from verl.utils.megatron.router_replay_utils import iter_model_routers, set_model_router_replay_action

    from verl_ds4.layout import PlanOptions
    from verl_ds4.mcore.thd import make_plan, pack_input, packed_seq_params_for
    from verl_ds4.models.ds4.router_replay import model_routers

    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    parallel_state.initialize_model_parallel(context_parallel_size=world)
    try:
        RouterReplay.router_instances.clear()
        group = parallel_state.get_context_parallel_group()
        cp_rank = parallel_state.get_context_parallel_rank()
        out = {"found_without_flag": len(list(iter_model_routers(_build(folder, False, world))))}
        model = _build(folder, True, world)
        found = sorted(iter_model_routers(model), key=lambda item: item[0])  # verl's own walk
        replays = [r for _, r in found]
        out["layers"] = [n for n, _ in found]
        out["n_registry"] = len(RouterReplay.router_instances)
        out["hash_routers"] = sum(int(router.is_hash) for _, router in model_routers(model))
        out["engram_layers"] = [layer.layer_number for layer in model.decoder.layers if layer.engram is not None]
        input_ids = _batch(model.output_layer.weight.shape[0])
        plan = make_plan(input_ids, PlanOptions(layout="contiguous", cp_size=world, min_local_rows=int(model.config.min_local_rows)))
        params = packed_seq_params_for(plan, layout_consumer_checked=True)
        ids, positions = pack_input(input_ids, plan, cp_rank)

        def forward():
            with torch.no_grad():
                logits = model(ids, positions, None, packed_seq_params=params)
            return plan.unpack(logits[0], group=group).values()

        out["native"] = forward().numpy()
        set_model_router_replay_action(model, RouterReplayAction.RECORD)
        out["recorded_logits"] = forward().numpy()
        local = torch.stack([r.get_recorded_indices() for r in replays], dim=1)  # [rows, layers, k]
        out["routes"] = plan.unpack(local, group=group).values().numpy()  # [T, layers, k], original order
        if replay_routes is not None:
            def replay(routes):
                packed = plan.pack(torch.as_tensor(routes), cp_rank)
                RouterReplay.clear_global_indices()
                for layer, r in enumerate(replays):
                    r.set_target_indices(packed[:, layer, :].long())
                set_model_router_replay_action(model, RouterReplayAction.REPLAY_FORWARD)
                return forward().numpy()

            out["replayed"] = replay(replay_routes)
            experts = int(model.config.num_moe_experts)
            for name, layer in (("perturbed_engram_layer", out["engram_layers"][0] - 1), ("perturbed_plain_layer", 6)):
                routes = np.array(replay_routes, copy=True)
                routes[:, layer, :] = (routes[:, layer, :] + 1) % experts
                out[name] = replay(routes)
            RouterReplay.clear_global_indices()
            replays[1].set_target_indices(torch.as_tensor(replay_routes)[:, 1, :].long())  # not packed: all T rows
            try:
                forward()
                out["unpacked_error"] = None
            except ValueError as err:
                out["unpacked_error"] = str(err)
        return out if rank == 0 else None
    finally:
        RouterReplay.router_instances.clear()
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from verl_ds4.cpu.sft_data import prepare_cpu_sft_assets

    return prepare_cpu_sft_assets(tmp_path_factory.mktemp("ds41rr"), model="ds41", n_train=2)["model"]


@pytest.fixture(scope="module")
def cp1(folder):
    return run_distributed(_replay_worker, world_size=1, args=(folder, None), timeout=600)[0]


@pytest.fixture(scope="module")
def cp2(folder, cp1):
    return run_distributed(_replay_worker, world_size=2, args=(folder, cp1["routes"]), timeout=600)[0]


def test_the_builder_wires_every_v41_router_for_verls_walk(cp1, cp2):
    for run in (cp1, cp2):
        assert run["layers"] == list(range(1, 9)) and run["n_registry"] == 8
        assert run["found_without_flag"] == 0  # the control: router_replay.mode disabled leaves them alone
        assert run["hash_routers"] == 0 and run["engram_layers"] == [2, 4]


def test_recorded_routes_cp2_equal_cp1(cp1, cp2):
    assert cp1["routes"].shape == (sum(LENGTHS), 8, 2)
    np.testing.assert_array_equal(cp2["routes"], cp1["routes"])
    np.testing.assert_array_equal(cp1["recorded_logits"], cp1["native"])  # recording does not change the forward
    for layer in range(8):  # every layer really routes to several experts
        assert len(np.unique(cp1["routes"][:, layer, :])) > 1


def test_replaying_cp1_routes_at_cp2_reproduces_the_outputs(cp1, cp2):
    np.testing.assert_allclose(cp2["replayed"], cp2["native"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(cp2["native"], cp1["native"], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("which", ["perturbed_engram_layer", "perturbed_plain_layer"])
def test_perturbed_routes_change_the_outputs(cp2, which):
    assert np.max(np.abs(cp2[which] - cp2["native"])) > 1e-4


def test_routes_not_packed_with_the_plan_are_rejected(cp2):
    assert cp2["unpacked_error"] is not None and "Pack the recorded routes" in cp2["unpacked_error"]


def _verl_r3_worker(rank: int, world: int, folder: str):
    import logging

    from megatron.core import parallel_state
    from verl.utils.megatron.router_replay_patch import RouterReplay, RouterReplayAction
    from verl.utils.megatron.router_replay_utils import (
        merge_router_topk_indices,
        set_model_router_replay_action,
        set_router_replay_data,
    )

    from verl_ds4.engine.megatron import active_layout, install_verl_hooks
    from verl_ds4.mcore.model_forward import pack_thd
    from verl_ds4.mcore.resolver import resolve_cp_layout

    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    parallel_state.initialize_model_parallel(context_parallel_size=world)
    try:
        RouterReplay.router_instances.clear()
        install_verl_hooks()  # a forked rank: its own copy of verl's modules
        import verl.utils.megatron.router_replay_utils as replay_utils

        replay_utils.device_name = "cpu"  # what verl reads under VERL_PLATFORM=cpu
        group = parallel_state.get_context_parallel_group()
        model = _build(folder, True, world)
        input_ids = _batch(model.output_layer.weight.shape[0])
        resolved = resolve_cp_layout(model, cp_size=world)
        with active_layout(resolved):
            ids, params = pack_thd(input_ids, resolved, pre_process=True)[:2]
            plan = params.plan

            def forward():
                with torch.no_grad():
                    logits = model(ids, None, None, packed_seq_params=params)
                return plan.unpack(logits[0], group=group).values()

            native = forward()
            set_model_router_replay_action(model, RouterReplayAction.RECORD)
            forward()
            merged: list = []
            merge_router_topk_indices(None, input_ids, merged, model.config, model=model)
            routes = merged[0]  # jagged [B, j, layers, topk], original order
            RouterReplay.clear_global_indices()
            set_router_replay_data(routes, None, model.config, model=model)
            set_model_router_replay_action(model, RouterReplayAction.REPLAY_FORWARD)
            replayed = forward()
            shifted = torch.nested.nested_tensor_from_jagged((routes.values() + 1) % int(model.config.num_moe_experts),
                                                             offsets=routes.offsets())  # fmt: skip
            RouterReplay.clear_global_indices()
            set_router_replay_data(shifted, None, model.config, model=model)
            perturbed = forward()
        out = {"routes": routes.values().long().numpy(), "native": native.numpy(), "replayed": replayed.numpy(), "perturbed": perturbed.numpy()}
        return out if rank == 0 else None
    finally:
        RouterReplay.router_instances.clear()
        parallel_state.destroy_model_parallel()


def test_verls_r3_merge_and_replay_use_the_micro_batch_plan(folder, cp1):
    for world in (1, 2):
        run = run_distributed(_verl_r3_worker, world_size=world, args=(folder,), timeout=600)[0]
        np.testing.assert_array_equal(run["routes"], cp1["routes"])  # verl's merge == our plan's unpack
        np.testing.assert_allclose(run["replayed"], run["native"], rtol=0, atol=1e-12)
        assert np.max(np.abs(run["perturbed"] - run["native"])) > 1e-4
