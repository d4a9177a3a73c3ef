"""Rollout indexer replay (verl_ds4/mcore/indexer_replay.py) on the tiny DS4 and DeepSeek-V4.1, fp64.

Models from the CPU jobs' folders through the CPU builders (the actor's model), the indexers' weights
redrawn so their scores spread; every forward is verl-ds4's engine forward (``gptmodel_forward_model_engine``
with the resolved layout) and the replayed choices reach it as in the engine (the jagged batch field,
packed with the micro-batch's one THD plan; each CP rank gets its own query rows):

* **a forced near-tie** (V4.1): the "rollout" (CP 1) sees, on the row / layer with the batch's smallest
  gap between the weakest chosen and the strongest unchosen reachable score, that unchosen score raised by
  1.000001 x the gap, so the two swap, as a rollout engine's other kernel can decide a near-tie. The
  "recompute" is the actor's forward at CP 2. Without replay its log-probs differ from the rollout's;
  with the rollout's recorded choices replayed they are equal to fp64 rounding;
* **CP 1 / 2 / 4** (DS4 and V4.1): the rollout's own forward (CP 1, recording) and the replayed recompute at
  each CP size give the same log-prob on every token (1e-12); the choices recorded at CP 2 and 4 equal CP 1's;
* controls: recording leaves the forward unchanged (bit-equal); a replayed choice moved to another
  reachable block changes the log-probs; bad inputs (a layer too few, an id past the row's compressed
  length, no field at all) are refused naming the field, the expected and the found shape (an id past the
  row's length by every CP rank, before the forward: one rank alone would leave the others waiting);
* no replay target outlives its forward: a native forward after a replaying one equals the native forward
  (fp64, bit-equal; control: the target left in place makes it the replayed forward), and verl's BSHD forward
  (which packs no field) refuses a replaying micro-batch (control: a native one runs).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl_ds4.mcore.distributed import run_distributed

LENGTHS = (61, 9, 47, 38)
TOL = 1e-12
DS4_CSA_LAYERS = 2  # the tiny DS4's selecting (CSA, ratio 4) layers


def _build(folder: str, kind: str):
    from transformers import AutoConfig

    from verl_ds4.cpu.builders import cpu_transformer_overrides
    from verl_ds4.cpu.ds4_builder import DS4_CPU_BUILDER
    from verl_ds4.cpu.ds41_builder import DS41_CPU_BUILDER

    builder = DS41_CPU_BUILDER if kind == "ds41" else DS4_CPU_BUILDER
    hf = AutoConfig.from_pretrained(folder)
    config = builder.transformer_config(hf, torch.float64, cpu_transformer_overrides({}))
    model = builder.build(config, hf, pre_process=True, post_process=True, share_embeddings=False).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".indexer." in name and param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float64) * param.shape[1] ** -0.5)
    return model


def _batch(vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, vocab, (sum(LENGTHS),), generator=gen)
    return torch.nested.nested_tensor_from_jagged(ids, offsets=torch.tensor([0, *LENGTHS]).cumsum(0))


def _nested(field, like: torch.Tensor) -> torch.Tensor:
    return torch.nested.nested_tensor_from_jagged(torch.as_tensor(np.ascontiguousarray(field)), offsets=like.offsets())


class _Runner:
    """The model at this rank's CP size and the engine forward with or without a replayed field."""

    def __init__(self, folder: str, kind: str, world: int, input_ids: torch.Tensor | None = None):
        from megatron.core import parallel_state

        from verl_ds4.mcore import indexer_replay
        from verl_ds4.mcore.resolver import resolve_cp_layout

        self.model = _build(folder, kind)
        self.resolved = resolve_cp_layout(self.model, cp_size=world)
        self.input_ids = _batch(self.model.output_layer.weight.shape[0]) if input_ids is None else input_ids
        self.layers = indexer_replay.selecting_layers(self.model)
        self.group = parallel_state.get_context_parallel_group()
        indexer_replay.enable(self.model, record=True)

    def forward(self, field=None, replay: bool = False, record: bool = True):
        """(per-token log-probs of the next token, last rows dropped; the choices recorded, all rows)."""
        from verl_ds4.mcore import batch_plans, indexer_replay
        from verl_ds4.mcore.model_forward import gptmodel_forward_model_engine

        with batch_plans.micro_batch_plans(), torch.no_grad(), indexer_replay.micro_batch_scope():
            if replay:
                indexer_replay.set_pending(None if field is None else _nested(field, self.input_ids))
            logits = gptmodel_forward_model_engine(self.model, self.input_ids, {}, resolved=self.resolved)
            plan = batch_plans.plan_for(self.input_ids, self.resolved.plan_options(None))
            choices = plan.unpack(indexer_replay.recorded(self.model), group=self.group) if record else None
        logp = torch.log_softmax(logits.values(), dim=-1)
        logp = logp.gather(1, self.input_ids.values().roll(-1).unsqueeze(1)).squeeze(1)
        keep = torch.ones_like(logp, dtype=torch.bool)
        keep[self.input_ids.offsets()[1:] - 1] = False
        return logp[keep].numpy(), None if choices is None else choices.values().numpy()

    def capture_scores(self) -> dict[int, torch.Tensor]:
        captured, originals = {}, []
        for i, (_, module) in enumerate(self.layers):
            indexer = module.core_attention.indexer
            original = indexer.scores

            def capture(*args, _i=i, _orig=original, **kwargs):
                out = _orig(*args, **kwargs)
                captured[_i] = out.detach().clone()
                return out

            indexer.scores = capture
            originals.append((indexer, original))
        self.forward()
        for indexer, original in originals:
            indexer.scores = original
        return captured

    def nudge(self, layer: int, row: int, entry: int, delta: float) -> None:
        indexer = self.layers[layer][1].core_attention.indexer
        original = indexer.scores

        def nudged(*args, **kwargs):
            out = original(*args, **kwargs).clone()
            out[row, entry] += delta
            return out

        indexer.scores = nudged


def _reach(row: int, ratio: int) -> int:
    offsets = np.cumsum((0, *LENGTHS))
    seq = int(np.searchsorted(offsets, row, side="right")) - 1
    return (row - int(offsets[seq]) + 1) // ratio


def _nearest_tie(runner: _Runner, field: np.ndarray) -> tuple[int, int, int, float]:
    """V4.1 (scores over each row's own entries; CP 1, no padding between sequences): the (layer, row,
    unchosen entry, gap) with the smallest gap between the weakest chosen and strongest unchosen score."""
    scores = runner.capture_scores()
    best = None
    for i, (_, module) in enumerate(runner.layers):
        if module.role.candidate_source is not None:
            continue  # a hierarchical layer ranks inside candidates only: the plain top-k rows are the clean case
        for row in range(scores[i].shape[0]):
            reach = _reach(row, module.role.ratio)
            chosen = [int(e) for e in field[row, i] if e >= 0]
            if reach <= module.indexer_replay_width:
                continue
            rest = [e for e in range(reach) if e not in chosen]
            weakest = min(float(scores[i][row, e]) for e in chosen)
            entry = max(rest, key=lambda e: float(scores[i][row, e]))
            gap = weakest - float(scores[i][row, entry])
            if gap > 0 and (best is None or gap < best[3]):
                best = (i, row, entry, gap)
    return best


def _rollout_worker(rank: int, world: int, folder: str, kind: str, nudge):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(context_parallel_size=world)
    try:
        runner = _Runner(folder, kind, world)
        out = {"layers": [name for name, _ in runner.layers]}
        out["logp"], out["field"] = runner.forward()
        if nudge is not None:
            layer, row, entry, gap = nudge
            runner.nudge(layer, row, entry, gap * 1.000001)
            out["nudged_logp"], out["nudged_field"] = runner.forward()
            return out if rank == 0 else None
        if kind == "ds41":
            out["tie"] = _nearest_tie(runner, out["field"])
        for _, module in runner.layers:  # control: without the replay objects the forward is bit-equal
            module.indexer_replay = None
        out["plain_logp"], _ = runner.forward(record=False)
        return out if rank == 0 else None
    finally:
        parallel_state.destroy_model_parallel()


def _recompute_worker(rank: int, world: int, folder: str, kind: str, field):
    from megatron.core import parallel_state

    from verl_ds4.mcore import indexer_replay
    from verl_ds4.mcore.indexer_replay import IndexerReplayError

    parallel_state.initialize_model_parallel(context_parallel_size=world)
    try:
        runner = _Runner(folder, kind, world)
        out = {}
        out["native_logp"], out["native_field"] = runner.forward()
        out["logp"], out["replayed_field"] = runner.forward(field, replay=True)
        moved = np.array(field, copy=True)
        out["moved_at"] = _move_one_choice(moved)
        out["moved_logp"], _ = runner.forward(moved, replay=True)
        # no target outlives its forward: a native forward right after the (moved) replay is the native one
        out["after_replay_logp"], _ = runner.forward(record=False)
        runner.forward(moved, replay=True)
        forget = indexer_replay.forget_targets
        indexer_replay.forget_targets = lambda model: None  # control: leave the replay's target in place
        try:
            out["stale_logp"], _ = runner.forward(record=False)
        finally:
            indexer_replay.forget_targets = forget
        errors = {}
        beyond = np.array(field, copy=True)
        beyond[LENGTHS[0] - 2, 0, 0] = 10_000
        # every case at every CP size: the row of "beyond" is on one rank, yet all ranks refuse (no hang)
        cases = [("layers", np.asarray(field)[:, :-1]), ("missing", None), ("beyond", beyond)]
        for name, bad in cases:
            try:
                runner.forward(bad, replay=True)
                errors[name] = None
            except IndexerReplayError as err:
                errors[name] = str(err)
        out["errors"] = errors
        return out if rank == 0 else None
    finally:
        parallel_state.destroy_model_parallel()


def _move_one_choice(field: np.ndarray) -> tuple[int, int]:
    """Swap, in place, one chosen id of the last selecting layer for an unchosen reachable block."""
    layer = field.shape[1] - 1
    for row in range(field.shape[0]):
        chosen = [int(i) for i in field[row, layer] if i >= 0]
        if len(chosen) == field.shape[2] and max(chosen) + 1 > len(chosen):
            field[row, layer, 0] = min(set(range(max(chosen) + 1)) - set(chosen))
            field[row, layer] = np.sort(field[row, layer])
            return layer, row
    raise AssertionError("no row reaches more blocks than it selects: lengthen LENGTHS")


@pytest.fixture(scope="module", params=["ds41", "ds4"])
def rollout(request, tmp_path_factory):
    from verl_ds4.cpu.sft_data import prepare_cpu_sft_assets

    kind = request.param
    folder = prepare_cpu_sft_assets(tmp_path_factory.mktemp(f"ir_{kind}"), model=kind, n_train=2)["model"]
    return kind, folder, run_distributed(_rollout_worker, world_size=1, args=(folder, kind, None), timeout=600)[0]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_replayed_recompute_equals_the_rollout_at_every_cp_size(rollout, world):
    kind, folder, run = rollout
    field = run["field"]
    assert field.shape == (sum(LENGTHS), len(run["layers"]), 8)  # index_topk 8 in both tiny models
    assert len(run["layers"]) == (4 if kind == "ds41" else DS4_CSA_LAYERS), run["layers"]
    out = run_distributed(_recompute_worker, world_size=world, args=(folder, kind, field), timeout=600)[0]
    np.testing.assert_array_equal(out["native_field"], field)  # the split does not change the choice
    np.testing.assert_array_equal(out["replayed_field"], field)
    np.testing.assert_allclose(out["logp"], run["logp"], rtol=0, atol=TOL)
    # control: one moved choice is another function
    assert np.max(np.abs(out["moved_logp"] - run["logp"])) > 1e-6, out["moved_at"]
    np.testing.assert_array_equal(out["after_replay_logp"], out["native_logp"])  # the replay's target is gone
    np.testing.assert_array_equal(out["stale_logp"], out["moved_logp"])  # control: a target left in place replays
    errors = out["errors"]
    assert "expected [tokens, " in errors["layers"] and "found [" in errors["layers"] and "indexer_topk" in errors["layers"]
    # refused before the forward on every rank (rank 0's message; the bad row is in sequence 0)
    assert f"sequence 0 row {LENGTHS[0] - 2} reaches" in errors["beyond"], errors["beyond"]
    assert "compressed blocks (ids 0.." in errors["beyond"] and "10000" in errors["beyond"]
    assert "has no 'indexer_topk' field" in errors["missing"] and "indexer_replay=false" in errors["missing"]


def test_recording_does_not_change_the_forward(rollout):
    kind, _, run = rollout
    np.testing.assert_array_equal(run["logp"], run["plain_logp"])
    field = run["field"]
    assert (field[:, :, 0] >= 0).any(axis=0).all()  # every selecting layer chose
    assert ((field >= 0).sum(axis=2) == 8).any()  # rows that reach more than index_topk blocks exist


@pytest.mark.parametrize("rollout", ["ds41"], indirect=True)  # built on V4.1 (its scores are per own-sequence entry)
def test_a_near_tie_flipped_at_rollout_is_replayed_in_the_recompute(rollout):
    kind, folder, run = rollout
    layer, row, entry, gap = run["tie"]
    rollout_run = run_distributed(_rollout_worker, world_size=1, args=(folder, kind, run["tie"]), timeout=600)[0]
    nudged_field, nudged_logp = rollout_run["nudged_field"], rollout_run["nudged_logp"]
    changed = np.argwhere((nudged_field != run["field"]).any(axis=2))
    assert [row, layer] in changed.tolist() and entry in nudged_field[row, layer]  # the near-tie flipped there
    # the actor's recompute at CP 2: without replay it chooses natively (the unnudged scores)
    recompute = run_distributed(_recompute_worker, world_size=2, args=(folder, kind, nudged_field), timeout=600)[0]
    without = np.max(np.abs(recompute["native_logp"] - nudged_logp))
    with_replay = np.max(np.abs(recompute["logp"] - nudged_logp))
    print(f"near-tie: layer {run['layers'][layer]}, row {row}, gap {gap:.3e}; changed rows x layers {len(changed)}; "
          f"max |log-prob diff| without replay {without:.3e} ({int((np.abs(recompute['native_logp'] - nudged_logp) > 1e-12).sum())} "
          f"tokens > 1e-12), with replay {with_replay:.3e}")
    assert without > 1e-9
    assert with_replay <= TOL


# ------------------------------------------------------------------ the rollout's record, decode step by step

PROMPTS = (40, 29)
NEW_TOKENS = 6


def _decode_worker(rank: int, world: int, folder: str):
    """The cpu_demo rollout's policy (fp64, the weights of :func:`_build`): greedy decode step by step,
    recording the choices (earlier rows replay theirs). Returns the sequences, the per-step log-probs of the
    sampled tokens and the final choices."""
    from transformers import AutoConfig

    import verl_ds4.cpu.ds41_builder  # noqa: F401  (registers deepseek_v41 with transformers)
    from verl_ds4.rollout.policy import MegatronCPUPolicy

    policy = MegatronCPUPolicy(AutoConfig.from_pretrained(folder), dtype=torch.float64)
    policy.load_weights(_build(folder, "ds41").named_parameters())
    gen = torch.Generator().manual_seed(11)
    seqs = [torch.randint(3, policy.vocab_size, (n,), generator=gen).tolist() for n in PROMPTS]
    known = [None] * len(seqs)
    logps = [[] for _ in seqs]
    for _ in range(NEW_TOKENS):
        logits, known = policy.next_token_logits_and_choices(seqs, known)
        for i, row in enumerate(torch.log_softmax(logits.double(), dim=-1)):
            token = int(row.argmax())
            seqs[i].append(token)
            logps[i].append(float(row[token]))
    from verl_ds4.mcore import indexer_replay

    replays = [module.indexer_replay for _, module in indexer_replay.selecting_layers(policy.model)]
    left = [(r.target is not None, r.record, r.last is not None) for r in replays]
    wrong = [torch.zeros(3, len(replays), 7, dtype=torch.int32)] * len(seqs)  # a width that is not index_topk
    try:
        policy.next_token_logits_and_choices(seqs, wrong)
        refused = None
    except ValueError as err:
        refused = str(err)
    left_after_refusal = [(r.target is not None, r.record, r.last is not None) for r in replays]
    return {"seqs": seqs, "logps": logps, "choices": [c.numpy() for c in known], "left": left,
            "refused": refused, "left_after_refusal": left_after_refusal}  # fmt: skip


def _replay_decoded_worker(rank: int, world: int, folder: str, decoded, replay: bool):
    from megatron.core import parallel_state

    from verl_ds4.mcore import indexer_replay

    parallel_state.initialize_model_parallel(context_parallel_size=world)
    try:
        seqs = decoded["seqs"]
        offsets = torch.tensor([0, *[len(s) for s in seqs]]).cumsum(0)
        ids = torch.nested.nested_tensor_from_jagged(torch.tensor([t for s in seqs for t in s]), offsets=offsets)
        runner = _Runner(folder, "ds41", world, input_ids=ids)
        rows = []
        for seq, choice in zip(seqs, decoded["choices"]):
            full = np.full((len(seq), *choice.shape[1:]), indexer_replay.NOT_RECORDED, dtype=np.int32)
            full[: choice.shape[0]] = choice
            rows.append(full)
        logp, _ = runner.forward(np.concatenate(rows), replay=replay)
        return logp if rank == 0 else None
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def decoded(tmp_path_factory):
    from verl_ds4.cpu.sft_data import prepare_cpu_sft_assets

    folder = prepare_cpu_sft_assets(tmp_path_factory.mktemp("ir_decode"), model="ds41", n_train=2)["model"]
    return folder, run_distributed(_decode_worker, world_size=1, args=(folder,), timeout=600)[0]


def test_the_rollout_records_one_choice_per_row_as_it_decodes(decoded):
    _, out = decoded
    for seq, choice in zip(out["seqs"], out["choices"]):
        assert choice.shape == (len(seq) - 1, 4, 8) and choice.dtype == np.int32  # every row it ran; not the last token
        assert (choice[:, :, 0] != -2).all()


def test_the_rollout_leaves_no_target_nor_recording_behind_even_when_refused(decoded):
    _, out = decoded
    assert out["left"] == [(False, False, False)] * 4  # (target, recording, record) after each decode step
    assert "indexer_topk rows: expected [rows, 4, 8], found [3, 4, 7]" in out["refused"]  # the bad known rows
    assert out["left_after_refusal"] == [(False, False, False)] * 4


def test_fill_rows_pads_with_not_recorded_and_refuses_other_layers():
    from verl_ds4.mcore.indexer_replay import NOT_RECORDED, fill_rows

    rows = torch.arange(2 * 3 * 4, dtype=torch.int64).view(2, 3, 4)
    out = fill_rows(rows, 5, (3, 4))
    assert out.dtype == torch.int32 and out.shape == (5, 3, 4)
    assert torch.equal(out[:2], rows.int()) and (out[2:] == NOT_RECORDED).all()
    assert torch.equal(fill_rows(rows, 1), rows[:1].int())  # rows past the sequence are dropped
    assert (fill_rows(None, 3, (3, 4)) == NOT_RECORDED).all()
    with pytest.raises(ValueError, match=r"expected \[rows, 3, 5\], found \[2, 3, 4\]"):
        fill_rows(rows, 5, (3, 5))  # control: other layers / width


def test_verls_bshd_forward_refuses_a_replaying_micro_batch(monkeypatch):
    """verl's BSHD forward packs no indexer field: a replaying micro-batch there would choose natively in
    silence. Refused naming the switch and use_remove_padding; a native micro-batch (control) runs, and drops a
    target a replaying forward left."""
    from types import SimpleNamespace

    import verl.models.mcore.model_forward as verl_forward

    from verl_ds4.mcore import indexer_replay
    from verl_ds4.mcore.model_forward import gptmodel_forward_model_engine

    class Selecting(torch.nn.Module):
        indexer_replay_width = 2

    model = torch.nn.Sequential(Selecting())
    indexer_replay.enable(model)
    calls = []
    stub = lambda *a, **k: calls.append(k["data_format"]) or "ran"  # noqa: E731  (verl's forward, not run here)
    monkeypatch.setattr(verl_forward, "gptmodel_forward_model_engine", stub)
    resolved = SimpleNamespace(cp_size=1, dynamic_cp=False, layout="contiguous", min_local_rows=0,
                               pad_to_length_bucket=None)  # fmt: skip
    ids = torch.zeros(2, 5, dtype=torch.long)
    with indexer_replay.micro_batch_scope():
        indexer_replay.set_pending(torch.zeros(2, 5, 1, 2, dtype=torch.int32))
        with pytest.raises(indexer_replay.IndexerReplayError,
                           match=r"indexer_replay=true\), but this micro-batch runs verl's BSHD forward.*"
                                 r"use_remove_padding=true, or actor_rollout_ref.actor.megatron.indexer_replay=false"):  # fmt: skip
            gptmodel_forward_model_engine(model, ids, {}, data_format="bshd", resolved=resolved)
    assert calls == []
    model[0].indexer_replay.target = torch.zeros(10, 2, dtype=torch.int32)  # left by a replaying forward
    assert gptmodel_forward_model_engine(model, ids, {}, data_format="bshd", resolved=resolved) == "ran"
    assert calls == ["bshd"] and model[0].indexer_replay.target is None


def test_replaying_the_rollouts_choices_at_cp2_gives_its_log_probs(decoded):
    folder, out = decoded
    logp = run_distributed(_replay_decoded_worker, world_size=2, args=(folder, out, True), timeout=600)[0]
    # the sampled tokens' log-probs: the last NEW_TOKENS predictions of each sequence (rows before its last)
    starts = np.cumsum([0, *[len(s) - 1 for s in out["seqs"]]])
    got = np.concatenate([logp[end - NEW_TOKENS : end] for end in starts[1:]])
    # the policy hands the sampler float32 logits (MegatronCPUPolicy): 2e-8 here, not fp64 rounding
    np.testing.assert_allclose(got, np.concatenate(out["logps"]), rtol=0, atol=1e-6)


def test_agent_loop_output_puts_the_choices_in_a_tensor_field_over_the_whole_sequence():
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    from verl_ds4.rollout.agent_loop import with_indexer_choices

    rows = torch.arange(5 * 2 * 3, dtype=torch.int32).view(5, 2, 3)
    plain = AgentLoopOutput(prompt_ids=[1, 2, 3], response_ids=[4, 5, 6], response_mask=[1, 1, 1],
                            metrics=AgentLoopMetrics(), extra_fields={"indexer_topk": rows, "x": 1})  # fmt: skip
    out = with_indexer_choices(plain).as_dict()
    assert out["indexer_topk"].shape == (6, 2, 3) and out["indexer_topk"].dtype == torch.int32
    assert torch.equal(out["indexer_topk"][:5], rows) and (out["indexer_topk"][5] == -2).all()
    assert "indexer_topk" not in out["extra_fields"] and out["extra_fields"]["x"] == 1
    control = AgentLoopOutput(prompt_ids=[1], response_ids=[2], response_mask=[1], metrics=AgentLoopMetrics())
    assert "indexer_topk" not in with_indexer_choices(control).as_dict()


def test_a_model_without_an_indexer_and_a_replaying_critic_are_refused():
    from types import SimpleNamespace

    from verl_ds4.engine.megatron import DS4MegatronEngineWithValueHead
    from verl_ds4.mcore.indexer_replay import IndexerReplayError, enable

    with pytest.raises(IndexerReplayError, match="needs a model whose sparse-attention indexer can replay.*Linear has none"):
        enable(torch.nn.Linear(2, 2))
    with pytest.raises(IndexerReplayError, match="critic.megatron.indexer_replay=true"):
        DS4MegatronEngineWithValueHead._check_startup_settings(None, None, SimpleNamespace(indexer_replay=True))


def test_ds4_indexer_loss_still_trains_on_its_own_scores_under_replay():
    """DS4's indexer loss (KL of the main attention over all visible blocks vs the indexer's scores) does not
    read the top-k: under a replayed choice that differs from the native one, the loss and the indexer's
    gradients are the native ones, while the output (which attends to the chosen blocks) differs (control)."""
    from verl_ds4.mcore.indexer_replay import IndexerReplay, mask_to_ids
    from verl_ds4.models.ds4.attention import DS4AttentionSpec, DS4HybridAttention

    spec = DS4AttentionSpec(hidden_size=32, num_heads=2, head_dim=16, rope_dim=8, q_lora_rank=16, o_groups=2,
                            o_lora_rank=8, compress_ratio=4, window_size=4, index_n_heads=2, index_head_dim=8,
                            index_topk=2, indexer_loss_coeff=0.1, yarn_factor=None)  # fmt: skip
    torch.manual_seed(0)
    attn = DS4HybridAttention(spec, dtype=torch.float64).train()
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(40, 32, dtype=torch.float64)
    cu = torch.tensor([0, 40])

    def run(target):
        attn.zero_grad(set_to_none=True)
        attn.indexer_replay = IndexerReplay("attn", spec.index_topk)
        attn.indexer_replay.record = True
        attn.indexer_replay.target = target
        out = attn(x, cu)
        out.pow(2).sum().backward()
        grads = {n: p.grad.clone() for n, p in attn.named_parameters() if ".indexer." in n and p.grad is not None}
        return out.detach(), attn.last_indexer_loss.clone(), grads, attn.indexer_replay.last

    native_out, native_loss, native_grads, chosen = run(None)
    reach = (torch.arange(40) + 1) // 4
    flipped = torch.zeros(40, int(reach.max()), dtype=torch.bool)
    for t in range(40):  # the two lowest reachable blocks instead of the indexer's choice
        flipped[t, : min(2, int(reach[t]))] = True
    target = mask_to_ids(flipped, spec.index_topk)
    assert not torch.equal(target, chosen)  # the replayed choice differs somewhere
    out, loss, grads, _ = run(target)
    assert torch.equal(loss, native_loss)
    assert grads.keys() == native_grads.keys() and grads
    for name in grads:
        torch.testing.assert_close(grads[name], native_grads[name], rtol=0, atol=1e-12)
    assert (out - native_out).abs().max() > 1e-6  # control: the output does follow the replayed choice
