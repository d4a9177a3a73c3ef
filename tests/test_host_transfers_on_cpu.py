"""One plan and one device-to-host transfer per micro-batch, on every data path (CP=2, gloo).

A ``TorchFunctionMode`` (``verl_ds4.testing.host_transfers``) counts the calls that transfer to the
host on a GPU (``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``.to('cpu')``, ``int()``,
``torch.equal``, boolean-mask indexing, ...) while one micro-batch runs through each path, inside the
plan scope the engine opens per ``forward_step``. The model is the tiny real ``GPTModel`` with the
per-token attention (it makes no host reads of its own); the MTP path uses a recording stand-in model
because a real GPTModel given labels returns its loss, not per-row outputs.
Negative control: an ``.item()`` injected into the plan lookup is counted.
"""

from __future__ import annotations

import io

import pytest
import torch

from verl_ds4.mcore.distributed import run_distributed

LENGTHS = [5, 37, 20]
VOCAB = 64


class _RecordingModel(torch.nn.Module):
    """Returns per-row logits ``[1, rows, VOCAB]`` from the packed ids (MTP path stand-in)."""

    pre_process = post_process = True

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, VOCAB)

    def forward(self, input_ids, attention_mask=None, position_ids=None, packed_seq_params=None, **kwargs):
        self.kwargs = kwargs
        return self.embed(input_ids)


def _worker(rank: int, world_size: int):
    import verl.models.mcore.model_forward_fused as verl_fused
    import verl.utils.megatron.router_replay_utils as router_replay_utils
    from megatron.core import parallel_state as mpu
    from tensordict import TensorDict
    from verl.models.mcore.model_forward_fused import patch_fused_forward, unpatch_fused_forward
    from verl.utils import tensordict_utils as tu

    from verl_ds4.engine.megatron import active_layout, install_verl_hooks
    from verl_ds4.mcore import batch_plans, resolver
    from verl_ds4.mcore.model_forward import gptmodel_forward_model_engine, refresh_dynamic_cp_padding
    from verl_ds4.mcore.model_forward_fused import fused_forward_model_engine
    from verl_ds4.testing.host_transfers import count_host_transfers
    from verl_ds4.testing.tiny_gpt import PerTokenAttention, build_tiny_gpt

    mpu.initialize_model_parallel(context_parallel_size=world_size)
    install_verl_hooks()
    verl_fused.linear_cross_entropy = lambda hidden, weight, labels, temperature, reduction, group: (
        torch.log_softmax(hidden.reshape(-1, hidden.shape[-1]) @ weight.t(), -1).gather(-1, labels.reshape(-1, 1))[:, 0],
        torch.zeros(labels.numel()),
    )
    attention = lambda i: PerTokenAttention("contiguous", 16)  # noqa: E731
    lm = build_tiny_gpt(vocab_size=VOCAB, attention=attention, seed=1)
    critic = build_tiny_gpt(vocab_size=VOCAB, attention=attention, value_head=True, seed=2)
    resolved = resolver.resolved_for(lm)
    resolver.register_layout(critic, resolved)

    ids = torch.arange(1, sum(LENGTHS) + 1) % VOCAB
    offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])

    def nested(values):  # every tensor its own offsets object, as verl's TensorDicts give them
        return torch.nested.nested_tensor_from_jagged(values, offsets=offsets.clone())

    def processor(logits, label, temperature):
        return {"log_probs": torch.log_softmax(logits.float() / temperature.unsqueeze(-1), -1)
                .gather(-1, label.unsqueeze(-1)).squeeze(-1)}  # fmt: skip

    def lm_args():
        return {"label": nested(ids.clone()), "temperature": nested(torch.ones(ids.numel()))}

    def run_lm():
        gptmodel_forward_model_engine(lm, nested(ids), {}, logits_processor=processor,
                                      logits_processor_args=lm_args(), resolved=resolved)  # fmt: skip

    def run_fused():
        patch_fused_forward(lm)
        try:
            fused_forward_model_engine(False)(lm, nested(ids), nested(ids.clone()), {}, 1.0, False, 0, resolved=resolved)
        finally:
            unpatch_fused_forward(lm)

    def run_value():
        gptmodel_forward_model_engine(critic, nested(ids), {}, value_model=True, resolved=resolved)

    mtp_model = _RecordingModel()
    resolver.register_layout(mtp_model, resolved)
    padded_labels = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.long)  # verl's padded MTP labels

    def run_mtp():
        args = {**lm_args(), "label": padded_labels.clone(), "loss_mask": nested(torch.ones(ids.numel()))}
        gptmodel_forward_model_engine(mtp_model, nested(ids), {}, logits_processor=lambda logits, **kw: {"x": logits},
                                      logits_processor_args=args, mtp_enable_train=True, resolved=resolved)  # fmt: skip

    def run_router_replay():  # verl packs the routes, then the model runs, then routes come back
        routes = nested(torch.stack([ids, ids], -1).to(torch.int32))
        with active_layout(resolved):
            rows, params, _ = router_replay_utils.preprocess_thd_engine(routes, pre_process=True)
            router_replay_utils.postprocess_thd_engine(rows, params, nested(ids), len(LENGTHS), post_process=True)
        run_lm()

    dyn = resolver.ResolvedCPLayout(layout="contiguous", min_local_rows=16, cp_size=1, tp_size=1, dynamic_cp=True)
    cp_group = mpu.get_context_parallel_group()
    mpu.get_dynamic_data_context_parallel_groups = lambda group_size: cp_group  # this process only

    def run_dynamic_cp():  # the scheduler's plan travels with the micro-batch into the forward
        batch = TensorDict({"input_ids": nested(ids)}, batch_size=[len(LENGTHS)])
        tu.assign_non_tensor_data(batch, "local_cp_size", world_size)
        refresh_dynamic_cp_padding(batch, dyn, cp_group)
        batch_plans.seed_plan(tu.get_non_tensor_data(batch, key=batch_plans.PLAN_KEY, default=None))
        gptmodel_forward_model_engine(lm, batch["input_ids"], {}, logits_processor=processor,
                                      logits_processor_args=lm_args(), local_cp_size=world_size, resolved=dyn)  # fmt: skip

    paths = {"lm": run_lm, "fused": run_fused, "value": run_value, "mtp": run_mtp,
             "router_replay+lm": run_router_replay, "dynamic_cp": run_dynamic_cp}  # fmt: skip
    counts = {}
    for name, fn in paths.items():
        with batch_plans.micro_batch_plans(), count_host_transfers() as counter:  # one micro-batch
            fn()
        counts[name] = counter.events

    original = batch_plans.plan_for

    def plan_for_with_a_read(input_ids, options, cp_group=None):
        input_ids.offsets()[-1].item()  # the injected extra transfer
        return original(input_ids, options, cp_group=cp_group)

    batch_plans.plan_for = plan_for_with_a_read
    try:
        with batch_plans.micro_batch_plans(), count_host_transfers() as counter:
            run_lm()
    finally:
        batch_plans.plan_for = original
    counts["lm_with_injected_item"] = counter.events
    mpu.destroy_model_parallel()
    buffer = io.BytesIO()
    torch.save(counts, buffer)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def counts():
    blobs = run_distributed(_worker, 2, timeout=600)
    return [torch.load(io.BytesIO(b), weights_only=False) for b in blobs]


@pytest.mark.parametrize("path", ["lm", "fused", "value", "router_replay+lm", "dynamic_cp"])
def test_one_host_transfer_per_micro_batch(counts, path):
    for rank_counts in counts:
        events = rank_counts[path]
        assert len(events) == 1, (path, events)
        assert events[0][1].startswith("layout/plan.py"), events  # the plan's one transfer of the lengths


def test_mtp_reads_lengths_from_the_plan(counts):
    """Ours: the plan's one transfer; verl's ``_build_mtp_loss_mask_nested`` reads the response offsets."""
    for rank_counts in counts:
        ours = [e for e in rank_counts["mtp"] if "verl/" not in e[1] and "mcore/model_forward.py" not in e[1]]
        verls = [e for e in rank_counts["mtp"] if e[1].startswith("mcore/model_forward.py")]
        assert len(ours) == 1 and ours[0][1].startswith("layout/plan.py"), rank_counts["mtp"]
        assert len(rank_counts["mtp"]) == 1 + len(verls), rank_counts["mtp"]


def test_counter_sees_an_injected_item(counts):
    for rank_counts in counts:
        assert len(rank_counts["lm_with_injected_item"]) == len(rank_counts["lm"]) + 1
        assert ("item", "tests/test_host_transfers_on_cpu.py") in {
            (kind, where.split(":")[0]) for kind, where in rank_counts["lm_with_injected_item"]
        }


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_no_cuda_synchronisation_after_the_plan():
    """On a GPU: building the plan is the one sync; packing and unpacking run under sync_debug 'error'."""
    from verl_ds4.layout import PlanOptions
    from verl_ds4.mcore import batch_plans
    from verl_ds4.testing.host_transfers import cuda_sync_errors

    offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], device="cuda")
    ids = torch.nested.nested_tensor_from_jagged(torch.arange(sum(LENGTHS), device="cuda"), offsets=offsets)
    with batch_plans.micro_batch_plans():
        plan = batch_plans.plan_for(ids, PlanOptions(layout="contiguous", cp_size=1, min_local_rows=16))
        with cuda_sync_errors():
            again = batch_plans.plan_for(ids, PlanOptions(layout="contiguous", cp_size=1, min_local_rows=16))
            rows = plan.pack(ids.values(), 0)
            back = plan.unpack(rows.float())
    assert again is plan
    torch.cuda.synchronize()
    assert torch.equal(back.values().long(), ids.values())
