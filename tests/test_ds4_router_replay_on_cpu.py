"""verl's router replay (R3) on the full tiny DS4: every MoE layer, the hash layer included.

The DS4 routers cooperate with verl's ``RouterReplay`` (verl 0.9.1's
``router_replay_patch.RouterReplay`` and ``router_replay_utils.iter_model_routers`` /
``set_model_router_replay_action`` find them). On real gloo ranks:

* RECORD at CP=1 and CP=2: the per-layer ``[rows, topk]`` routes, unpacked with each micro-batch's
  THD plan, are identical; the hash layer's routes are its ``tid2eid`` table at the token ids.
* REPLAY_FORWARD at CP=2 of CP=1's routes, packed with CP=2's plan: the logits equal the native
  forward's; negative controls: routes shifted by one expert, on a top-k layer or on the hash layer,
  change the logits; routes packed without the plan (wrong shape) raise.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl_ds4.mcore.distributed import run_distributed

LENGTHS = (5, 127, 300, 23, 129, 55)


def _replay_worker(rank: int, world: int, replay_routes):
    import logging

    from megatron.core import parallel_state
    from verl.utils.megatron.router_replay_patch import RouterReplay, RouterReplayAction
    from verl.utils.megatron.router_replay_utils import iter_model_routers, set_model_router_replay_action

    from verl_ds4.verify.parity import _Models, _batch
    from verl_ds4.layout import PlanOptions
    from verl_ds4.mcore.thd import make_plan, pack_input, packed_seq_params_for
    from verl_ds4.models.ds4.router_replay import enable_router_replay

    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    parallel_state.initialize_model_parallel(context_parallel_size=world)
    try:
        RouterReplay.router_instances.clear()
        group = parallel_state.get_context_parallel_group()
        cp_rank = parallel_state.get_context_parallel_rank()
        models = _Models("ds4", None, seed=1234)
        model = models.build(torch.float64).eval()
        replays = enable_router_replay(model)
        found = sorted(iter_model_routers(model), key=lambda item: item[0])  # verl's own walk
        input_ids, _ = _batch(LENGTHS, models.vocab, seed=5)
        plan = make_plan(input_ids, PlanOptions(layout="contiguous", cp_size=world, min_local_rows=int(model.config.min_local_rows)))
        params = packed_seq_params_for(plan, layout_consumer_checked=True)
        ids, positions = pack_input(input_ids, plan, cp_rank)

        def forward():
            with torch.no_grad():
                logits = model(ids, positions, None, packed_seq_params=params)
            return plan.unpack(logits[0], group=group).values()

        out = {"layers": [n for n, _ in found], "n_registry": len(RouterReplay.router_instances)}
        out["same_objects"] = [r is f for r, (_, f) in zip(replays, found)]
        out["native"] = forward().numpy()
        set_model_router_replay_action(model, RouterReplayAction.RECORD)
        recorded = forward().numpy()
        local = torch.stack([r.get_recorded_indices() for r in replays], dim=1)  # [rows, layers, k]
        out["recorded_logits"] = recorded
        out["routes"] = plan.unpack(local, group=group).values().numpy()  # [T, layers, k], original order
        out["hash_table_routes"] = model.decoder.layers[0].mlp.router.tid2eid[input_ids.values()].numpy()
        if replay_routes is not None:
            def replay(routes):
                packed = plan.pack(torch.as_tensor(routes), cp_rank)  # [rows, layers, k]
                RouterReplay.clear_global_indices()
                for layer, r in enumerate(replays):
                    r.set_target_indices(packed[:, layer, :].long())
                set_model_router_replay_action(model, RouterReplayAction.REPLAY_FORWARD)
                return forward().numpy()

            out["replayed"] = replay(replay_routes)
            E = models.cfg["n_routed_experts"]
            for name, layer in (("perturbed_topk", 2), ("perturbed_hash", 0)):
                routes = np.array(replay_routes, copy=True)
                routes[:, layer, :] = (routes[:, layer, :] + 1) % E
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
def cp1():
    return run_distributed(_replay_worker, world_size=1, args=(None,), timeout=600)[0]


@pytest.fixture(scope="module")
def cp2(cp1):
    return run_distributed(_replay_worker, world_size=2, args=(cp1["routes"],), timeout=600)[0]


def test_every_moe_layer_is_found_by_verls_router_walk(cp1, cp2):
    for run in (cp1, cp2):
        assert run["layers"] == [1, 2, 3, 4] and run["n_registry"] == 4 and all(run["same_objects"])


def test_recorded_routes_cp2_equal_cp1_hash_layer_included(cp1, cp2):
    assert cp1["routes"].shape == (sum(LENGTHS), 4, 2)
    np.testing.assert_array_equal(cp2["routes"], cp1["routes"])
    np.testing.assert_array_equal(cp1["routes"][:, 0, :], cp1["hash_table_routes"])  # layer 1 is hash_moe
    # recording does not change the forward
    np.testing.assert_array_equal(cp1["recorded_logits"], cp1["native"])
    assert len(np.unique(cp1["routes"][:, 2, :])) > 1  # the top-k layers really route to several experts


def test_replaying_cp1_routes_at_cp2_reproduces_the_outputs(cp1, cp2):
    np.testing.assert_allclose(cp2["replayed"], cp2["native"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(cp2["native"], cp1["native"], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("which", ["perturbed_topk", "perturbed_hash"])
def test_perturbed_routes_change_the_outputs(cp2, which):
    assert np.max(np.abs(cp2[which] - cp2["native"])) > 1e-3


def test_routes_not_packed_with_the_plan_are_rejected(cp2):
    assert cp2["unpacked_error"] is not None and "Pack the recorded routes" in cp2["unpacked_error"]


# ---------------------------------------------------------------- verl's own R3 functions


def _verl_r3_worker(rank: int, world: int):
    """verl's merge_router_topk_indices / set_router_replay_data(model=...) on the DS4 model, with
    verl-ds4's hooks on router_replay_utils and the engine's resolved layout active."""
    import logging

    from megatron.core import parallel_state
    from verl.utils.megatron.router_replay_patch import RouterReplay, RouterReplayAction
    from verl.utils.megatron.router_replay_utils import (
        merge_router_topk_indices,
        set_model_router_replay_action,
        set_router_replay_data,
    )

    from verl_ds4.verify.parity import _Models, _batch
    from verl_ds4.engine.megatron import active_layout, install_verl_hooks
    from verl_ds4.mcore.model_forward import pack_thd
    from verl_ds4.mcore.resolver import resolve_cp_layout
    from verl_ds4.models.ds4.router_replay import enable_router_replay

    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    parallel_state.initialize_model_parallel(context_parallel_size=world)
    try:
        RouterReplay.router_instances.clear()
        install_verl_hooks()  # a forked rank: its own copy of verl's modules
        import verl.utils.megatron.router_replay_utils as replay_utils

        replay_utils.device_name = "cpu"  # what verl reads under VERL_PLATFORM=cpu (the CPU jobs' platform)
        group = parallel_state.get_context_parallel_group()
        models = _Models("ds4", None, seed=1234)
        model = models.build(torch.float64).eval()
        enable_router_replay(model)
        input_ids, _ = _batch(LENGTHS, models.vocab, seed=5)
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
            perturbed_routes = torch.nested.nested_tensor_from_jagged((routes.values() + 1) % models.cfg["n_routed_experts"], offsets=routes.offsets())
            RouterReplay.clear_global_indices()
            set_router_replay_data(perturbed_routes, None, model.config, model=model)
            perturbed = forward()
        out = {"routes": routes.values().long().numpy(), "native": native.numpy(), "replayed": replayed.numpy(), "perturbed": perturbed.numpy()}
        return out if rank == 0 else None
    finally:
        RouterReplay.router_instances.clear()
        parallel_state.destroy_model_parallel()


def test_verls_r3_merge_and_replay_use_the_micro_batch_plan(cp1):
    one = run_distributed(_verl_r3_worker, world_size=1, timeout=600)[0]
    two = run_distributed(_verl_r3_worker, world_size=2, timeout=600)[0]
    for run in (one, two):
        np.testing.assert_array_equal(run["routes"], cp1["routes"])  # verl's merge == our plan's unpack
        np.testing.assert_allclose(run["replayed"], run["native"], rtol=0, atol=1e-12)
        assert np.max(np.abs(run["perturbed"] - run["native"])) > 1e-3
