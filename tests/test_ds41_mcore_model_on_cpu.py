"""The tiny V4.1 as a real Megatron-Core ``GPTModel`` (``verl_ds4.models.ds41.mcore_model``) against
NeMo Automodel 0.7.0 at fp64, at CP 1, 2 and 4 on real gloo processes.

Four ragged sequences (odd lengths, so ratio-2 blocks and Engram n-grams cross rank boundaries) are
packed by verl-ds4's THD plan with the contiguous layout and the model's ``min_local_rows``
(``verl_ds4.models.ds4.hf_check.run_on_cp_ranks``, as V4's checks); each sequence's logits must equal
the reference's forward of that sequence alone (<= 1e-10 relative). Negative controls: token ids
handed to Engram one row off (the plan's ids, rolled) differ; a zigzag CP partition and a bad V4.1
schedule are refused when the config is built.
"""

from __future__ import annotations

import pytest
import torch

from verl_ds4.models.ds41.engram import engram_token_map
from verl_ds4.models.ds41.model import DS41Model
from verl_ds4.testing import ds41_reference as ref

pytestmark = pytest.mark.skipif(ref.reference_missing() is not None, reason=str(ref.reference_missing()))

TEXT = ref.tiny_text_config()


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


class Builder:
    """``build(cp_size)`` on each gloo rank (forked: the weights come from the parent). With
    ``value_head`` the critic: the same decoder, a seeded hidden -> 1 head."""

    def __init__(self, state_dict, table, value_head: bool = False):
        self.state_dict, self.table, self.value_head = state_dict, table, value_head

    def __call__(self, cp_size: int):
        from verl_ds4.models.ds41.mcore_model import DS41MegatronModel, ds41_transformer_config

        model = DS41MegatronModel(ds41_transformer_config(TEXT, torch.float64, cp_size), self.table, value_head=self.value_head)
        state = dict(self.state_dict)
        if self.value_head:
            state["output_layer.weight"] = torch.randn(1, TEXT["hidden_size"], dtype=torch.float64,
                                                       generator=torch.Generator().manual_seed(9))  # fmt: skip
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
        return model.eval()


@pytest.fixture(scope="module")
def setup():
    with ref.fp64_reference():
        theirs = ref.build_reference_model(TEXT)
    table = engram_token_map(ref.local_tokenizer())[0]
    ours = DS41Model(TEXT, table, dtype=torch.float64)
    ref.copy_reference_weights(ours, theirs)
    g = torch.Generator().manual_seed(3)
    sequences = [torch.randint(0, TEXT["vocab_size"], (n,), generator=g) for n in (13, 30, 7, 21)]
    with ref.fp64_reference(), torch.no_grad():
        expected = [theirs(s.view(1, -1)).logits[0] for s in sequences]
    return Builder(ours.state_dict(), table), sequences, expected


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_megatron_model_equals_the_reference(setup, cp):
    from verl_ds4.models.ds4.hf_check import run_on_cp_ranks

    build, sequences, expected = setup
    got = run_on_cp_ranks(build, sequences, cp)
    err = max(rel(a, b) for a, b in zip(got, expected))
    print(f"V4.1 Megatron GPTModel CP={cp}: per-sequence logits {err:.1e} relative to NeMo Automodel (fp64)")
    assert err <= 1e-10


def test_negative_control_engram_ids_one_row_off(setup):
    from verl_ds4.models.ds4.hf_check import run_on_cp_ranks

    build, sequences, expected = setup
    got = run_on_cp_ranks(build, sequences, 2, hash_ids_shift=1)
    err = max(rel(a, b) for a, b in zip(got, expected))
    print(f"Engram ids one row off: {err:.1e}")
    assert err > 1e-3


def test_config_refusals_at_start_up():
    from verl_ds4.models.ds41.mcore_model import ds41_transformer_config

    assert ds41_transformer_config(TEXT, torch.float64, 1).min_local_rows == 4  # window 4 > ratio 2, Engram 2
    with pytest.raises(ValueError, match="cp_partition_mode='zigzag' with CP=2.*contiguous"):
        ds41_transformer_config(TEXT, torch.float64, 2, cp_partition_mode="zigzag")
    with pytest.raises(ValueError, match="kv_source_layer_ids=.*Add layer 2"):
        ds41_transformer_config(dict(TEXT, kv_source_layer_ids=[3, 5], index_source_layer_ids=[3, 5, 6]), torch.float64, 1)


def _resolve(rank: int, world: int, declare: bool):
    from megatron.core import parallel_state

    from verl_ds4.mcore.resolver import CPLayoutError, resolve_cp_layout
    from verl_ds4.models.ds41.csa2 import DS41Attention
    from verl_ds4.models.ds41.engram import EngramHasher
    from verl_ds4.models.ds41.mcore_model import DS41MegatronModel, ds41_transformer_config

    if not declare:  # negative control: modules that do not say which split they read
        DS41Attention.required_cp_partition_mode = None
        EngramHasher.required_cp_partition_mode = None
    parallel_state.initialize_model_parallel(context_parallel_size=world)
    try:
        model = DS41MegatronModel(ds41_transformer_config(TEXT, torch.float64, world), engram_token_map(ref.local_tokenizer())[0])
        out = []
        for overrides in (None, {"cp_partition_mode": "zigzag"}):
            try:
                resolved = resolve_cp_layout(model, cp_size=world, user_overrides=overrides)
                out.append(f"{resolved.layout} {resolved.min_local_rows}")
            except CPLayoutError as exc:
                out.append(f"refused: {exc}")
        return out
    finally:
        parallel_state.destroy_model_parallel()


def test_the_engine_layout_resolver_reads_the_v41_declarations():
    """verl-ds4's resolver (the one place a CP layout is decided) finds what the V4.1 modules need:
    contiguous, >= 4 rows (window 4; Engram 2); it refuses a zigzag override; without the
    declarations it refuses the model at CP 2 (negative control)."""
    from verl_ds4.mcore.distributed import run_distributed

    plain, zigzag = run_distributed(_resolve, world_size=2, args=(True,))[0]
    assert plain == "contiguous 4", plain
    assert zigzag.startswith("refused:") and "EngramHasher" in zigzag and "DS41Attention" in zigzag, zigzag
    undeclared = run_distributed(_resolve, world_size=2, args=(False,))[0]
    assert all(r.startswith("refused:") and "found none" in r for r in undeclared), undeclared


def _train_step(rank: int, world: int, build, lengths, broken_halo: bool):
    """One actor step through verl-ds4's THD data path (``verl_ds4.verify.parity``: pack with the contiguous
    plan, log-probs, entropy, loss, backward) of the Megatron V4.1 model; gradients summed over CP."""
    from megatron.core import parallel_state

    from verl_ds4.verify.parity import _actor_step, _batch, _grads

    if broken_halo:  # negative control: the CSA2 left halo never arrives
        from verl_ds4.models.ds41 import csa2

        csa2.exchange_left_halo = lambda x, rows, group: torch.zeros_like(x[:rows])
    parallel_state.initialize_model_parallel(context_parallel_size=world)
    try:
        group = parallel_state.get_context_parallel_group() if world > 1 else None
        model = build(world)
        model.train()
        ids, _ = _batch(lengths, TEXT["vocab_size"], 5)
        per_token, loss = _actor_step(model, ids, "contiguous", parallel_state.get_context_parallel_rank(),
                                      model.config.min_local_rows, world, group)  # fmt: skip
        loss.backward()
        grads = {k: (None if v is None else v.tolist()) for k, v in _grads(model, group).items()}
        return (per_token.detach().tolist(), float(loss), grads) if rank == 0 else None
    finally:
        parallel_state.destroy_model_parallel()


def test_training_step_through_the_thd_path_is_cp_exact(setup):
    """log-probs, entropy, loss and every gradient (summed over ranks) of one training step at CP 2 and 4
    equal CP 1 (<= 1e-10); negative control: CSA2 without its halo changes them."""
    from verl_ds4.mcore.distributed import run_distributed

    build, _, _ = setup
    lengths = (5, 27, 40, 9, 33)
    runs = {cp: run_distributed(_train_step, world_size=cp, args=(build, lengths, False))[0] for cp in (1, 2, 4)}
    base_tokens, base_loss, base_grads = runs[1]
    base_tokens = torch.tensor(base_tokens, dtype=torch.float64)
    scale = max(float(torch.tensor(g, dtype=torch.float64).abs().max()) for g in base_grads.values() if g is not None)
    for cp in (2, 4):
        tokens, loss, grads = runs[cp]
        token_err = rel(torch.tensor(tokens, dtype=torch.float64), base_tokens)
        grad_err = max(
            float((torch.tensor(grads[n], dtype=torch.float64) - torch.tensor(g, dtype=torch.float64)).abs().max()) / max(float(torch.tensor(g, dtype=torch.float64).abs().max()), 1e-6 * scale)
            for n, g in base_grads.items() if g is not None
        )  # fmt: skip
        print(f"V4.1 training step CP={cp} vs CP=1: log-probs/entropy {token_err:.1e}, loss {abs(loss - base_loss) / abs(base_loss):.1e}, gradients {grad_err:.1e}")
        assert token_err <= 1e-10 and abs(loss - base_loss) <= 1e-10 * abs(base_loss) and grad_err <= 1e-10
        assert [n for n, g in grads.items() if g is None] == [n for n, g in base_grads.items() if g is None]
    tokens, loss, _ = run_distributed(_train_step, world_size=2, args=(build, lengths, True))[0]
    print(f"without the CSA2 halo: log-probs off by {rel(torch.tensor(tokens, dtype=torch.float64), base_tokens):.1e}")
    assert rel(torch.tensor(tokens, dtype=torch.float64), base_tokens) > 1e-3


def _critic_step(rank: int, world: int, build, lengths):
    from megatron.core import parallel_state

    from verl_ds4.verify.parity import _batch, _critic_step, _grads

    parallel_state.initialize_model_parallel(context_parallel_size=world)
    try:
        group = parallel_state.get_context_parallel_group() if world > 1 else None
        critic = build(world)
        ids, targets = _batch(lengths, TEXT["vocab_size"], 5)
        values, loss = _critic_step(critic, ids, targets, "contiguous", parallel_state.get_context_parallel_rank(),
                                    critic.config.min_local_rows, world)  # fmt: skip
        loss.backward()
        grads = {k: (None if v is None else v.tolist()) for k, v in _grads(critic, group).items()}
        return (values.detach().tolist(), float(loss), grads) if rank == 0 else None
    finally:
        parallel_state.destroy_model_parallel()


def test_value_head_critic_step_is_cp_exact(setup):
    """The critic (V4.1 decoder + hidden -> 1 head, verl's value model): values are the head applied to
    the LM model's final hidden rows, and values, value loss and gradients at CP 2 and 4 equal CP 1."""
    from verl_ds4.verify.parity import _batch
    from verl_ds4.mcore.distributed import run_distributed
    from verl_ds4.models.ds41.model import DS41Model, run_decoder

    build, _, _ = setup
    critic = Builder(build.state_dict, build.table, value_head=True)
    lengths = (5, 27, 40, 9, 33)
    runs = {cp: run_distributed(_critic_step, world_size=cp, args=(critic, lengths))[0] for cp in (1, 2, 4)}
    values = torch.tensor(runs[1][0], dtype=torch.float64)
    # the head on the decoder's final hidden rows (the pure-PyTorch model, sequence by sequence)
    ours = DS41Model(TEXT, build.table, dtype=torch.float64)
    ours.load_state_dict(build.state_dict)
    ids, _ = _batch(lengths, TEXT["vocab_size"], 5)
    head = torch.randn(1, TEXT["hidden_size"], dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        expected = torch.cat([
            ours.decoder.final_layernorm(run_decoder(ours.decoder.layers, ours.engram_hasher, ours.facts,
                                                     ours.embedding.word_embeddings(s), s)) @ head.T
            for s in ids.unbind()
        ])[:, 0]  # fmt: skip
    assert rel(values, expected) <= 1e-10
    base_grads = runs[1][2]
    scale = max(float(torch.tensor(g, dtype=torch.float64).abs().max()) for g in base_grads.values() if g is not None)
    for cp in (2, 4):
        got, loss, grads = runs[cp]
        grad_err = max(  # per tensor; a gradient that cancels to ~0 against the model's scale (as in the LM tests)
            float((torch.tensor(grads[n], dtype=torch.float64) - torch.tensor(g, dtype=torch.float64)).abs().max())
            / max(float(torch.tensor(g, dtype=torch.float64).abs().max()), 1e-6 * scale)
            for n, g in base_grads.items() if g is not None
        )  # fmt: skip
        print(f"V4.1 critic CP={cp} vs CP=1: values {rel(torch.tensor(got, dtype=torch.float64), values):.1e}, value loss "
              f"{abs(loss - runs[1][1]) / runs[1][1]:.1e}, gradients {grad_err:.1e}")  # fmt: skip
        assert rel(torch.tensor(got, dtype=torch.float64), values) <= 1e-10 and abs(loss - runs[1][1]) <= 1e-10 * runs[1][1] and grad_err <= 1e-10
