"""DS4's mixture of experts: a top-k or hash router, routed SwiGLU experts and one shared expert.

For token rows ``x [N, h]`` (any CP split: the MoE is row-wise, no communication at EP = 1)::

    s       = score(x @ router.weight^T)          # sqrtsoftplus | sigmoid | softmax, [N, E]
    chosen  = stable_topk(s + expert_bias, k)     # top-k layer: the bias moves the choice only
            = tid2eid[token_id]                   # hash layer: a frozen token -> experts table
    w       = s[chosen]; w /= sum(w) + 1e-20 (norm_topk_prob); w *= routed_scaling_factor
    y       = sum_k w_k * expert_{chosen_k}(x) + shared_expert(x)
    expert(x) = linear_fc2(silu(min(g, L)) * clamp(u, -L, L)),  [g | u] = linear_fc1(x),  L = swiglu_limit

**Top-k tie rule** (the same as the DS4 indexer's, :mod:`.attention`): equal scores are taken in
index order, lowest expert first, i.e. the order of ``torch.sort(..., descending=True,
stable=True)``. ``torch.topk`` leaves ties unspecified; tests run the reference under the same rule.

Experts are separate modules with separate parameters (Megatron-Core ``SequentialMLP`` names:
``experts.local_experts.<e>.linear_fc1.weight [2I, h]`` (gate rows first, then up),
``linear_fc2.weight [h, I]``; the router is ``router.weight [E, h]`` with the buffers
``router.expert_bias [E]`` (HF ``e_score_correction_bias``) or ``router.tid2eid [vocab, k]``).
All experts are local here (EP = 1); an EP split would give each rank a slice of
``local_experts`` and a token all-to-all around :meth:`DS4MoE._routed`, leaving the router as is.

**Router replay** (verl's R2 / R3): a router with ``router_replay`` set (an instance of verl's
``RouterReplay``, attached by :func:`verl_ds4.models.ds4.router_replay.enable_router_replay`)
chooses its experts through ``router_replay.get_replay_topk``: it records the ``[N, k]`` choice
(RECORD) or takes the given one (REPLAY_FORWARD / REPLAY_BACKWARD); the weights are then the
scores of the experts used. Hash layers take part like top-k layers (their native choice is the
``tid2eid`` lookup).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SCORE_FUNCTIONS", "stable_topk", "DS4Expert", "DS4Router", "DS4MoE"]

SCORE_FUNCTIONS = {
    "sqrtsoftplus": lambda logits: F.softplus(logits).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda logits: logits.softmax(dim=-1),
}


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``[..., k]`` of the ``k`` largest entries along the last dim; ties in index order."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


class DS4Expert(nn.Module):
    """One SwiGLU expert with DS4's clamp: ``fc2(silu(min(g, L)) * clamp(u, -L, L))``."""

    def __init__(self, hidden: int, intermediate: int, swiglu_limit: float | None, dtype=None):
        super().__init__()
        self.intermediate, self.limit = intermediate, swiglu_limit
        self.linear_fc1 = nn.Linear(hidden, 2 * intermediate, bias=False, dtype=dtype)
        self.linear_fc2 = nn.Linear(intermediate, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear_fc1(x).chunk(2, dim=-1)
        if self.limit is not None:
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
        return self.linear_fc2(F.silu(gate) * up)


class DS4Router(nn.Module):
    """Scores experts and picks ``top_k`` per token: learned top-k (``hash_vocab=None``) or hash."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        score_function: str,
        norm_topk_prob: bool,
        scaling_factor: float,
        hash_vocab: int | None = None,
        dtype=None,
    ):
        super().__init__()
        if score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"DS4 router scoring_func must be one of {sorted(SCORE_FUNCTIONS)}, got {score_function!r}.")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, n_routed_experts={num_experts}], got {top_k}.")
        self.num_experts, self.top_k = num_experts, top_k
        self.score_function, self.norm_topk_prob, self.scaling_factor = score_function, norm_topk_prob, scaling_factor
        self.is_hash = hash_vocab is not None
        self.router_replay = None  # verl's RouterReplay for this layer, when replay is enabled
        self.layer_number = None  # 1-based decoder layer, set with router_replay (verl addresses routers by it)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype))
        nn.init.normal_(self.weight, std=0.02)
        if self.is_hash:
            self.register_buffer("tid2eid", torch.zeros(hash_vocab, top_k, dtype=torch.long))
        else:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=dtype))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[N, h]`` (token_ids ``[N]`` for a hash router) -> ``(indices [N, k], weights [N, k])``."""
        scores = SCORE_FUNCTIONS[self.score_function](F.linear(x, self.weight))
        if self.is_hash:
            if token_ids is None or token_ids.shape != x.shape[:1]:
                got = None if token_ids is None else tuple(token_ids.shape)
                raise ValueError(
                    f"A hash_moe layer needs the token id of every row: expected token_ids of shape ({x.shape[0]},), "
                    f"got {got}. Pass the packed input ids of this rank's rows (the same plan as the hidden rows)."
                )
            native = lambda: self.tid2eid[token_ids.long()]  # noqa: E731
        else:
            native = lambda: stable_topk(scores + self.expert_bias, self.top_k)  # noqa: E731
        indices = native() if self.router_replay is None else self._replayed(scores, native)
        weights = scores.gather(-1, indices)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return indices, weights * self.scaling_factor


    def _replayed(self, scores: torch.Tensor, native) -> torch.Tensor:
        """The experts verl's RouterReplay picks (records the native ones, or returns the targets)."""

        def compute_topk(s, topk, num_groups=None, group_topk=None):
            idx = native()
            return s.gather(-1, idx), idx

        expected = (scores.shape[0], self.top_k)
        replay = self.router_replay
        action = getattr(getattr(replay, "router_replay_action", None), "value", None)
        pending = getattr(replay, "replay_backward_list", None) or [None]
        target = {"replay_forward": getattr(replay, "target_topk_idx", None), "replay_backward": pending[0]}.get(action)
        for routes in (target,) if target is not None else ():
            self._check_routes(routes, expected)
        _, indices = replay.get_replay_topk(scores, self.top_k, default_compute_topk=compute_topk)
        self._check_routes(indices, expected)
        return indices.long()

    def _check_routes(self, routes: torch.Tensor, expected: tuple[int, int]) -> None:
        if tuple(routes.shape) != expected:
            raise ValueError(
                f"Router replay of layer {self.layer_number}: expected routes of shape {expected} (this rank's rows x "
                f"top-k), got {tuple(routes.shape)}. Pack the recorded routes with this micro-batch's THD plan."
            )


class DS4MoE(nn.Module):
    """Router + ``num_experts`` routed :class:`DS4Expert` + one shared expert, on rows ``[N, h]``."""

    def __init__(self, hidden: int, router: DS4Router, intermediate: int, shared_intermediate: int, swiglu_limit, dtype=None):
        super().__init__()
        self.router = router
        self.experts = nn.Module()
        self.experts.local_experts = nn.ModuleList(
            DS4Expert(hidden, intermediate, swiglu_limit, dtype=dtype) for _ in range(router.num_experts)
        )
        self.shared_experts = DS4Expert(hidden, shared_intermediate, swiglu_limit, dtype=dtype)

    def _routed(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts.local_experts):
            rows, slot = torch.nonzero(indices == e, as_tuple=True)
            if rows.numel():
                out = out.index_add(0, rows, expert(x[rows]) * weights[rows, slot].unsqueeze(-1))
        return out

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        indices, weights = self.router(x, token_ids)
        return self._routed(x, indices, weights) + self.shared_experts(x)
