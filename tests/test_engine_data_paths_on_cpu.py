"""Every data path packs every per-token tensor with the one resolved layout (real GPTModel, CP=2, gloo).

Two ranks form a real Megatron CP group. The model is a real Megatron-Core ``GPTModel`` whose core
attention is a pure-PyTorch module that declares the CP layout it consumes (``PerTokenAttention``:
each row attends to itself, so every token's output depends only on its id and results can be
checked token by token). Paths exercised on each rank:

* LM head, non-fused (``verl_ds4.mcore.model_forward``): input ids, shifted labels, per-token
  temperatures, loss mask;
* LM head, fused (``verl_ds4.mcore.model_forward_fused``), through verl's patched ``GPTModel``
  forward; only verl's Triton kernel ``linear_cross_entropy`` is replaced by a PyTorch equivalent
  (Triton does not run on CPU);
* value head (non-fused forward with ``value_model=True``);
* router-replay routes ``[T, k]`` through verl's own ``router_replay_utils`` function names while
  the engine's layout is active.

Token ids are unique in the batch, so each packed row identifies its source token.
"""

from __future__ import annotations

import io

import pytest
import torch

from verl_ds4.mcore.distributed import run_distributed

LENGTHS = [5, 37, 20]  # 62 tokens: far fewer than cp * 128 rows
VOCAB = 128


def _cpu_linear_cross_entropy(hidden, weight, labels, temperature, reduction, group):
    """PyTorch stand-in for verl's Triton fused kernel: per-row log-prob of the label and entropy."""
    logits = hidden.reshape(-1, hidden.shape[-1]).float() @ weight.float().t() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, labels.reshape(-1, 1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _batch():
    ids = torch.arange(1, sum(LENGTHS) + 1)  # unique, non-zero token ids (0 marks padding rows)
    offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    nested = lambda values: torch.nested.nested_tensor_from_jagged(values, offsets=offsets)  # noqa: E731
    seq_of_token = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    return ids, offsets, seq_of_token, nested


def _run_paths(rank: int, world_size: int, layout: str, min_rows):
    import verl.models.mcore.model_forward_fused as verl_fused
    import verl.utils.megatron.router_replay_utils as router_replay_utils
    from megatron.core import parallel_state as mpu
    from verl.models.mcore.model_forward_fused import patch_fused_forward, unpatch_fused_forward

    from verl_ds4.engine.megatron import active_layout, install_verl_hooks
    from verl_ds4.mcore import resolver
    from verl_ds4.mcore.model_forward import gptmodel_forward_model_engine
    from verl_ds4.mcore.model_forward_fused import fused_forward_model_engine
    from verl_ds4.testing.tiny_gpt import PerTokenAttention, build_tiny_gpt

    mpu.initialize_model_parallel(context_parallel_size=world_size)
    install_verl_hooks()
    verl_fused.linear_cross_entropy = _cpu_linear_cross_entropy
    attention = lambda i: PerTokenAttention(layout, min_rows)  # noqa: E731
    lm = build_tiny_gpt(vocab_size=VOCAB, attention=attention, seed=1)
    critic = build_tiny_gpt(vocab_size=VOCAB, attention=attention, value_head=True, seed=2)
    resolved = resolver.resolved_for(lm)
    assert resolver.resolved_for(critic) == resolved

    seen = {}

    def record(name):
        def hook(module, args, kwargs):
            params = kwargs["packed_seq_params"]
            seen[name] = {
                "input_rows": kwargs["input_ids"][0].clone(),
                "labels": kwargs["labels"][0].clone() if kwargs.get("labels") is not None else None,
                "cu_seqlens_padded": params.cu_seqlens_q_padded.clone(),
                "cu_seqlens": params.cu_seqlens_q.clone(),
                "cp_partition_mode": getattr(params, "cp_partition_mode", None),
            }

        return hook

    def attention_rows(model):
        """Rows each layer's attention was given in the last forward (then forget them)."""
        rows = []
        for layer in model.decoder.layers:
            rows.append(layer.self_attention.core_attention.rows_seen[-1:])
            layer.self_attention.core_attention.rows_seen.clear()
        return rows

    ids, offsets, seq_of_token, nested = _batch()
    input_ids = nested(ids)
    temperature = nested((1.0 + 0.5 * seq_of_token).float())
    processor_args = {}

    def logits_processor(logits, label, temperature):
        processor_args.update(label=label[0].clone(), temperature=temperature[0].clone())
        scaled = logits.float() / temperature.unsqueeze(-1)
        log_probs = torch.log_softmax(scaled, dim=-1).gather(-1, label.unsqueeze(-1)).squeeze(-1)
        return {"log_probs": log_probs, "logits": logits.float()}

    out = {}
    handle = lm.register_forward_pre_hook(record("lm"), with_kwargs=True)
    lm_out = gptmodel_forward_model_engine(
        lm,
        input_ids,
        {},
        logits_processor=logits_processor,
        logits_processor_args={
            "label": input_ids.clone(),
            "temperature": temperature,
            "loss_mask": nested(torch.ones(ids.numel(), dtype=torch.bool)),
        },
        cp_layout=layout,
        resolved=resolved,
    )
    seen["lm"]["attention_rows"] = attention_rows(lm)
    out["lm"] = {k: v.values().detach() for k, v in lm_out.items()}
    out["lm_args"] = processor_args
    handle.remove()

    patch_fused_forward(lm)
    handle = lm.register_forward_pre_hook(record("fused"), with_kwargs=True)
    fused = fused_forward_model_engine(False)(
        lm, input_ids, input_ids.clone(), {}, 1.0, True, 0, cp_layout=layout, resolved=resolved
    )
    handle.remove()
    seen["fused"]["attention_rows"] = attention_rows(lm)
    unpatch_fused_forward(lm)
    out["fused"] = {k: v.values().detach() for k, v in fused.items()}

    handle = critic.register_forward_pre_hook(record("value"), with_kwargs=True)
    values = gptmodel_forward_model_engine(critic, input_ids, {}, value_model=True, resolved=resolved)
    handle.remove()
    seen["value"]["attention_rows"] = attention_rows(critic)
    out["values"] = values.values().detach()
    out["values_shape"] = tuple(values.values().shape)

    routes = nested(torch.stack([ids * 10, ids * 10 + 1], dim=-1).to(torch.int16))
    with active_layout(resolved):  # as inside the engine's forward_backward_batch
        rows, params, _ = router_replay_utils.preprocess_thd_engine(
            routes, pre_process=True, use_fp8_padding=False, min_local_rows=None, cp_layout="zigzag"
        )
        back = router_replay_utils.postprocess_thd_engine(
            rows.to(torch.int32), params, input_ids, len(LENGTHS), post_process=True, cp_layout="zigzag"
        )
    out["route_rows"] = rows[0]
    out["routes_back"] = back.values().to(torch.int16)
    out["routes"] = routes.values()
    out["seen"] = seen
    out["resolved"] = (resolved.layout, resolved.min_local_rows)
    mpu.destroy_model_parallel()
    buffer = io.BytesIO()  # tensors cross the process boundary as bytes (shared memory dies with the rank)
    torch.save(out, buffer)
    return buffer.getvalue()


@pytest.fixture(scope="module", params=[("contiguous", 128), ("zigzag", None)], ids=["contiguous-128", "zigzag"])
def ranks(request):
    layout, min_rows = request.param
    results = run_distributed(_run_paths, 2, args=(layout, min_rows), timeout=600)
    return layout, min_rows, [torch.load(io.BytesIO(blob), weights_only=False) for blob in results]


def test_every_path_feeds_the_model_identical_rows(ranks):
    layout, min_rows, results = ranks
    for rank, out in enumerate(results):
        assert out["resolved"] == (layout, min_rows)
        lm, fused, value = out["seen"]["lm"], out["seen"]["fused"], out["seen"]["value"]
        for other in (fused, value):
            assert torch.equal(lm["input_rows"], other["input_rows"]), rank
            assert torch.equal(lm["cu_seqlens_padded"], other["cu_seqlens_padded"]), rank
            assert torch.equal(lm["cu_seqlens"], other["cu_seqlens"]), rank
            assert other["cp_partition_mode"] == layout
        # cu_seqlens are global: identical on every rank.
        assert torch.equal(lm["cu_seqlens_padded"], results[0]["seen"]["lm"]["cu_seqlens_padded"])
        # The labels the fused kernel gets are the labels the non-fused logits processor gets.
        assert torch.equal(fused["labels"], out["lm_args"]["label"])


def test_min_local_rows_applies_on_every_path(ranks):
    layout, min_rows, results = ranks
    for out in results:
        for path in ("lm", "fused", "value"):
            rows = out["seen"][path]["attention_rows"]
            if min_rows:
                assert rows == [[min_rows], [min_rows]], (path, rows)  # 62 tokens padded to 2 * 128 rows
            else:
                assert rows[0] == rows[1] and 31 <= rows[0][0] < 64, (path, rows)


def test_labels_temperatures_and_routes_follow_the_input_rows(ranks):
    layout, _, results = ranks
    ids, offsets, seq_of_token, _ = _batch()
    next_token = torch.empty_like(ids)
    for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        next_token[start:end] = torch.roll(ids[start:end], -1)  # the label shift wraps inside a sequence
    for out in results:
        rows = out["seen"]["lm"]["input_rows"]
        valid = rows != 0
        source = rows[valid] - 1  # token index of each real row
        assert torch.equal(out["lm_args"]["label"][valid], next_token[source])
        assert torch.equal(out["lm_args"]["temperature"][valid], (1.0 + 0.5 * seq_of_token[source]).float())
        route_rows = out["route_rows"]
        assert torch.equal(route_rows[valid].long(), torch.stack([rows[valid] * 10, rows[valid] * 10 + 1], -1))
        assert not route_rows[~valid].any()
        assert torch.equal(out["routes_back"], out["routes"])
    # Together the ranks hold every token exactly once.
    all_rows = torch.cat([out["seen"]["lm"]["input_rows"] for out in results])
    assert torch.equal(torch.sort(all_rows[all_rows != 0]).values, ids)
    if layout == "contiguous":  # rank r holds global rows [r*L, (r+1)*L)
        assert torch.equal(all_rows[all_rows != 0], ids)


def test_outputs_come_back_per_token_and_agree_between_paths(ranks):
    layout, _, results = ranks
    ids, offsets, seq_of_token, _ = _batch()
    next_token = torch.empty_like(ids)
    for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        next_token[start:end] = torch.roll(ids[start:end], -1)
    for out in results:
        logits = out["lm"]["logits"]
        assert logits.shape == (ids.numel(), VOCAB)
        temp = (1.0 + 0.5 * seq_of_token).float()
        expected = torch.log_softmax(logits / temp[:, None], -1).gather(-1, next_token[:, None]).squeeze(-1)
        torch.testing.assert_close(out["lm"]["log_probs"], expected)
        fused_expected = torch.log_softmax(logits, -1).gather(-1, next_token[:, None]).squeeze(-1)
        torch.testing.assert_close(out["fused"]["log_probs"], fused_expected, rtol=1e-5, atol=1e-5)
        assert out["fused"]["entropy"].shape == (ids.numel(),)
        assert out["values_shape"] == (ids.numel(),)
        torch.testing.assert_close(out["values"], results[0]["values"])
        torch.testing.assert_close(logits, results[0]["lm"]["logits"])


def test_dynamic_cp_padding_mask_matches_the_packed_rows():
    """The router padding mask of a dynamic-CP micro-batch comes from the same plan as the tokens."""
    from types import SimpleNamespace

    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.utils.dynamic_cp_scheduler import DCP_LOCAL_NUM_TOKENS, DCP_PADDING_MASK

    from verl_ds4.mcore import thd
    from verl_ds4.mcore.model_forward import refresh_dynamic_cp_padding
    from verl_ds4.mcore.resolver import ResolvedCPLayout

    ids, offsets, _, nested = _batch()
    resolved = ResolvedCPLayout(layout="contiguous", min_local_rows=128, cp_size=4, tp_size=1, dynamic_cp=True)
    for dcp_rank in range(4):
        batch = TensorDict({"input_ids": nested(ids)}, batch_size=[len(LENGTHS)])
        tu.assign_non_tensor_data(batch, "local_cp_size", 2)
        tu.assign_non_tensor_data(batch, DCP_PADDING_MASK, torch.zeros(3, dtype=torch.bool))  # verl's (replaced)
        refresh_dynamic_cp_padding(batch, resolved, SimpleNamespace(rank=lambda: dcp_rank))
        mask = tu.get_non_tensor_data(batch, key=DCP_PADDING_MASK, default=None)
        plan = thd.make_plan(nested(ids), resolved.plan_options(local_cp_size=2))
        rows = plan.pack(ids, dcp_rank % 2)
        assert mask.shape == (128,)  # min_local_rows applies under dynamic CP too
        assert torch.equal(mask, rows == 0)
        assert tu.get_non_tensor_data(batch, key=DCP_LOCAL_NUM_TOKENS, default=None) == int((rows != 0).sum())


# ------------------------------------------------------------------ the real DS4 proxy, CP=2 vs CP=1


def _ds4_proxy_paths(rank: int, world_size: int):
    """LM log-probs and critic values of the pure-PyTorch DS4 proxy through our forward functions."""
    from megatron.core import parallel_state as mpu

    import dataclasses

    from verl_ds4.mcore import resolver, thd
    from verl_ds4.mcore.model_forward import gptmodel_forward_model_engine
    from verl_ds4.models.ds4.proxy import build_proxy_model

    mpu.initialize_model_parallel(context_parallel_size=world_size)
    lm = build_proxy_model(dtype=torch.float64)
    critic = build_proxy_model(dtype=torch.float64, value_head=True)
    resolved = resolver.resolved_for(lm)
    lengths = [300, 20, 24, 12, 180]  # the first sequence straddles the CP=2 boundary; balancing reorders
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 97, (sum(lengths),), generator=gen)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    input_ids = torch.nested.nested_tensor_from_jagged(ids, offsets=offsets)
    temperature = torch.nested.nested_tensor_from_jagged(torch.ones(ids.numel(), dtype=torch.float64), offsets=offsets)

    def log_probs(logits, label, temperature):
        scaled = logits / temperature.unsqueeze(-1)
        return {"log_probs": torch.log_softmax(scaled, -1).gather(-1, label.unsqueeze(-1)).squeeze(-1)}

    out = gptmodel_forward_model_engine(
        lm, input_ids, {}, logits_processor=log_probs,
        logits_processor_args={"label": input_ids.clone(), "temperature": temperature},
    )  # fmt: skip
    values = gptmodel_forward_model_engine(critic, input_ids, {}, value_model=True)
    # cp_balance on (the engine's knob): the buffer order changes, the per-token outputs must not
    balanced = dataclasses.replace(resolved, balance="ds4")
    out_b = gptmodel_forward_model_engine(
        lm, input_ids, {}, logits_processor=log_probs,
        logits_processor_args={"label": input_ids.clone(), "temperature": temperature}, resolved=balanced,
    )  # fmt: skip
    values_b = gptmodel_forward_model_engine(critic, input_ids, {}, value_model=True, resolved=balanced)
    order = thd.make_plan(input_ids, balanced.plan_options()).order
    result = {
        "resolved": (resolved.layout, resolved.min_local_rows, resolved.cp_size),
        "log_probs": out["log_probs"].values().detach().clone(),
        "values": values.values().detach().clone(),
        "log_probs_balanced": out_b["log_probs"].values().detach().clone(),
        "values_balanced": values_b.values().detach().clone(),
        "order": None if order is None else order.tolist(),
    }
    mpu.destroy_model_parallel()
    buffer = io.BytesIO()
    torch.save(result, buffer)
    return buffer.getvalue()


def test_ds4_proxy_lm_and_critic_match_between_cp1_and_cp2():
    cp1 = torch.load(io.BytesIO(run_distributed(_ds4_proxy_paths, 1, timeout=600)[0]), weights_only=False)
    cp2 = [torch.load(io.BytesIO(b), weights_only=False) for b in run_distributed(_ds4_proxy_paths, 2, timeout=600)]
    assert cp1["resolved"] == ("contiguous", 128, 1)
    assert cp1["order"] is None  # CP=1: nothing to balance
    for out in cp2:
        assert out["resolved"] == ("contiguous", 128, 2)
        torch.testing.assert_close(out["log_probs"], cp1["log_probs"], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(out["values"], cp1["values"], rtol=1e-9, atol=1e-9)
        # the balanced buffer really is reordered, and gives the same per-token outputs
        assert out["order"] is not None and out["order"] != sorted(out["order"]), out["order"]
        torch.testing.assert_close(out["log_probs_balanced"], cp1["log_probs"], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(out["values_balanced"], cp1["values"], rtol=1e-9, atol=1e-9)
