"""Critic correctness under CP: DS4-proxy values at CP=2 equal CP=1, and verl's GAE consumes them aligned.

Real parts: megatron-core's ``GPTModel`` with the pure-PyTorch DS4 attention (the tiny DS4 proxy
with a value head), Megatron's parallel state over real gloo processes (1 and 2 ranks),
verl-ds4's engine forward function :func:`verl_ds4.mcore.model_forward.gptmodel_forward_model_engine`
(``value_model=True``: one contiguous THD plan, DS4's minimum rows per CP rank, all-gather over CP),
verl's own ``no_padding_2_padding`` (how verl's critic loss and ``compute_values`` slice per-token
values to the response) and verl's own ``compute_gae_advantage_return``.

The batch has two prompt+response sequences whose boundary and whose response both straddle the
CP=2 rank boundary, so a shard reassembled in the wrong order or a value shifted by one row would
show up in the comparison and in the GAE returns.
"""

from __future__ import annotations

import functools

import pytest
import torch

GAMMA = 0.97
LAM = 0.9
# (prompt_len, response_len) per sequence: 230 tokens in all, padded at CP=2 to the proxy's minimum of
# 2 * 128 rows; rank 0 holds rows [0, 128): sequence 0 (rows 0..101) and the start of sequence 1, whose
# response starts at row 108 and crosses into rank 1.
SEQUENCES = ((40, 62), (6, 122))
VOCAB = 97


def _batch():
    gen = torch.Generator().manual_seed(11)
    lengths = [p + r for p, r in SEQUENCES]
    ids = torch.randint(0, VOCAB, (sum(lengths),), generator=gen)
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    return torch.nested.nested_tensor_from_jagged(ids, offsets=offsets)


def _critic_values(rank: int, world: int) -> list[torch.Tensor]:
    """Values of every token of the batch, from the proxy critic at CP=world (same weights on all ranks)."""
    import logging

    from megatron.core import parallel_state

    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    from verl_ds4.mcore import resolver
    from verl_ds4.mcore.model_forward import gptmodel_forward_model_engine
    from verl_ds4.models.ds4.proxy import build_proxy_model

    # megatron-core 0.16.1 (no PackedSeqParams.cp_partition_mode): the DS4 attention declares its
    # CP partition mode and reads the split from the rows, so nothing is emulated.
    parallel_state.initialize_model_parallel(context_parallel_size=world)
    try:
        critic = build_proxy_model(dtype=torch.float32, value_head=True, seed=2024)
        critic.eval()
        # Each DS4 attention layer declares its CP contract itself: contiguous rows and
        # D_window = max(window, compression ratio) rows per rank, 128 here because of the ratio-128 layer.
        resolved = resolver.resolved_for(critic)
        assert resolved.cp_size == world and resolved.layout == "contiguous", resolved.describe()
        assert resolved.min_local_rows == critic.config.min_local_rows == 128, resolved.describe()
        with torch.no_grad():
            values = gptmodel_forward_model_engine(critic, _batch(), {}, value_model=True, resolved=resolved)
        assert values.is_nested and values.dim() == 2, "the value path must return jagged [B, j] values"
        return [v.clone() for v in values.unbind()]
    finally:
        parallel_state.destroy_model_parallel()


@functools.lru_cache(maxsize=None)
def _values_at(cp_size: int) -> tuple[list[torch.Tensor], ...]:
    from verl_ds4.models.ds4 import proxy  # noqa: F401  (import megatron once; forked ranks start fast)
    from verl_ds4.mcore.distributed import run_distributed

    return tuple(run_distributed(_critic_values, world_size=cp_size, timeout=240))


@pytest.fixture(scope="module")
def values_cp1():
    return _values_at(1)[0]


@pytest.fixture(scope="module")
def values_cp2():
    return _values_at(2)


def _verl_response_values(values: list[torch.Tensor]) -> torch.Tensor:
    """verl's own slice of per-token values to the response: ``[B, max_response_len]``."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    batch = _batch()
    prompts, responses = [], []
    for seq, (p, _r) in zip(batch.unbind(), SEQUENCES):
        prompts.append(seq[:p])
        responses.append(seq[p:])
    data = TensorDict(
        {
            "prompts": torch.nested.as_nested_tensor(prompts, layout=torch.jagged),
            "responses": torch.nested.as_nested_tensor(responses, layout=torch.jagged),
        },
        batch_size=[len(SEQUENCES)],
    )
    tu.assign_non_tensor_data(data, "max_response_len", max(r for _, r in SEQUENCES))
    jagged = torch.nested.as_nested_tensor(values, layout=torch.jagged)
    return no_padding_2_padding(jagged, data)


def _rewards_and_mask():
    r_max = max(r for _, r in SEQUENCES)
    rewards = torch.zeros(len(SEQUENCES), r_max)
    mask = torch.zeros(len(SEQUENCES), r_max)
    for b, (_p, r) in enumerate(SEQUENCES):
        mask[b, :r] = 1
        rewards[b, r - 1] = 1.0 if b == 0 else -0.5  # outcome reward on the last response token
        rewards[b, r // 2] = 0.25  # and one intermediate token reward
    return rewards, mask


def _hand_gae(values: list[torch.Tensor], shift: int = 1):
    """GAE written out per sequence: the value of response token t is the critic's output at the token
    before it (position prompt_len + t - shift of the full sequence); terminal value 0."""
    rewards, mask = _rewards_and_mask()
    advantages = torch.zeros_like(rewards, dtype=torch.float64)
    returns = torch.zeros_like(rewards, dtype=torch.float64)
    for b, (p, r) in enumerate(SEQUENCES):
        v = [float(values[b][p + t - shift]) for t in range(r)]
        last = 0.0
        for t in reversed(range(r)):
            next_v = v[t + 1] if t + 1 < r else 0.0
            delta = float(rewards[b, t]) + GAMMA * next_v - v[t]
            last = delta + GAMMA * LAM * last
            advantages[b, t] = last
            returns[b, t] = last + v[t]
    valid = advantages[mask.bool()]
    whitened = (advantages - valid.mean()) / torch.sqrt(valid.var(unbiased=True) + 1e-8) * mask
    return whitened, returns, mask


def test_cp2_values_equal_cp1_per_token(values_cp1, values_cp2):
    rank0, rank1 = values_cp2
    for b, (p, r) in enumerate(SEQUENCES):
        assert values_cp1[b].shape == (p + r,), "one value per token of the sequence"
        # both CP ranks return the whole, all-gathered batch
        torch.testing.assert_close(rank1[b], rank0[b], rtol=0, atol=0)
        diff = (rank0[b] - values_cp1[b]).abs().max().item()
        print(f"seq {b} ({p}+{r} tokens): max |V_cp2 - V_cp1| = {diff:.3e}, |V| max {values_cp1[b].abs().max():.3f}")
        torch.testing.assert_close(rank0[b], values_cp1[b], rtol=1e-5, atol=1e-5)
    # The values carry information per token: a one-row misalignment would be visible at this tolerance.
    flat = torch.cat(values_cp1)
    assert flat.std() > 1e-2
    shifted = torch.cat([v.roll(1) for v in values_cp2[0]])
    assert not torch.allclose(shifted, flat, rtol=1e-5, atol=1e-5)


def test_verl_gae_consumes_cp2_values_aligned_with_their_tokens(values_cp1, values_cp2):
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    rewards, mask = _rewards_and_mask()
    response_values = _verl_response_values(values_cp2[0])
    assert response_values.shape == rewards.shape
    advantages, returns = compute_gae_advantage_return(
        token_level_rewards=rewards, values=response_values * mask, response_mask=mask, gamma=GAMMA, lam=LAM
    )
    # hand-computed from the CP=1 values, indexing the full sequences directly
    hand_adv, hand_ret, _ = _hand_gae(values_cp1)
    torch.testing.assert_close(returns * mask, hand_ret.float() * mask, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(advantages * mask, hand_adv.float(), rtol=1e-4, atol=1e-4)

    # negative control: values taken one token late (the response token itself) give different returns
    _, late_ret, _ = _hand_gae(values_cp1, shift=0)
    assert (late_ret.float() * mask - returns * mask).abs().max() > 1e-2
