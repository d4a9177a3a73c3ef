"""DeepSeek-V4.1 Engram: hashed n-grams of normalised token ids read a memory table into every mHC stream.

Three parts, each checked against NeMo Automodel 0.7.0's ``deepseek_v41.engram`` at fp64
(``tests/test_ds41_engram_on_cpu.py``):

* :func:`engram_token_map`: the tokenizer-normalisation table. Every token id is decoded alone and
  normalised (NFKC, NFD, accents stripped, lower case, whitespace runs to one space, then stripped,
  except a token that is exactly one space); ids with the same key share one compressed id. A decode
  with a replacement character uses the raw token string as its key.
* :class:`EngramHasher`: for packed rows ``[T]`` (one CP rank's contiguous slice), the ids of the
  n-grams ending at each row, order 2..N, ``engram_n_heads`` hashes each, per Engram layer:
  ``h_n = XOR_{k<n} (c_{t-k} * m_k)`` (``c`` compressed ids, ``m`` odd per-layer multipliers from
  ``numpy.random.default_rng(10007 * layer)``), ``row = h_n mod p_{n,j} + offset_{n,j}`` (``p``
  distinct primes above ``engram_vocab_size - 1``, ``ds41_facts.engram_hash_primes``). Lookback
  stops (the pad id is used instead) at a sequence start, at a masked token and before row 0 of
  the whole buffer. Under contiguous CP the first ``N - 1`` rows of rank ``r`` look back into rank
  ``r - 1``: the hasher takes that rank's last ``N - 1`` ids, sequence ids and mask through the
  left-halo P2P exchange of the V4 attention (:func:`~verl_ds4.models.ds4.cp_comm.exchange_left_halo`).
* :class:`DS41Engram`: one layer's table and gate. ``e = table[rows]`` (heads concatenated),
  ``[k_1..k_n, v] = linear_kv_proj(e)``; per stream ``s``:
  ``g_s = sigmoid(sign(d) sqrt(max(|d|, 1e-6)))``, ``d = <RMS(x_s) * query_norm_s, RMS(k_s) * key_norm_s> / sqrt(h)``,
  ``x_s' = x_s + g_s v`` (``g = 0`` on masked rows). No convolution (V4.1 dropped it).

Parameter names (Megatron-LM dev's Engram names where it has the same tensor; its module is the
earlier single-stream Engram with ``key_proj`` / ``value_proj`` and a short convolution, so the
fused projection and per-stream norm weights are named here): ``multi_head_embedding.weight``
``[rows, engram_head_dim]`` (NeMo ``embed.weight``), ``linear_kv_proj.weight``
``[(hc_mult + 1) * hidden, heads * engram_head_dim]`` (NeMo ``wkv.weight``), ``query_norm.weight`` /
``key_norm.weight`` ``[hc_mult, hidden]`` (NeMo ``q_weight`` / ``k_weight``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from verl_ds4 import ds41_facts, ds4_facts

from ..ds4.cp_comm import exchange_left_halo

__all__ = ["engram_token_map", "EngramHasher", "DS41Engram"]

_SPACE_RUNS = r"[ \t\r\n]+"


def engram_token_map(tokenizer: Any) -> tuple[list[int], int]:
    """``(compressed id of every token id, number of compressed ids)`` of a fast tokenizer."""
    from tokenizers import Regex, normalizers

    fold = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(_SPACE_RUNS), " "),
    ])  # fmt: skip
    strip = normalizers.Strip()
    backend = tokenizer.backend_tokenizer
    keys: dict[str, int] = {}
    table = []
    for token_id in range(len(tokenizer)):
        text = backend.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = backend.id_to_token(token_id)
        else:
            folded = fold.normalize_str(text)
            key = folded if folded == " " else strip.normalize_str(folded)
            key = key or text
        table.append(keys.setdefault(key, len(keys)))
    return table, len(keys)


class EngramHasher(nn.Module):
    """Table rows ``[T, engram layers, (N - 1) * heads]`` of packed token ids (see the module doc)."""

    #: The layout protocol (``verl_ds4.mcore.requirements``): the halo reads the previous rank's
    #: last ``N - 1`` rows of one contiguous split.
    required_cp_partition_mode: ClassVar[str] = ds4_facts.CP_PARTITION_MODE

    @property
    def min_local_rows(self) -> int:
        return self.order - 1

    def __init__(self, text: Any, token_map: Sequence[int]) -> None:
        super().__init__()
        get = _getter(text)
        layers = tuple(get("engram_layer_ids"))
        self.layer_ids = layers
        self.order = int(get("engram_max_ngram_size"))
        compressed = max(token_map) + 1
        if compressed != int(get("engram_compressed_vocab_size")):
            raise ValueError(
                f"engram_compressed_vocab_size={get('engram_compressed_vocab_size')}: the tokenizer normalises onto "
                f"{compressed} ids, and the hash multipliers depend on that count. Use the checkpoint's own tokenizer."
            )
        primes = ds41_facts.engram_hash_primes(text)  # [layer][order][head]
        flat = [[p for order in layer for p in order] for layer in primes]
        offsets = [list(np.cumsum([0] + row[:-1])) for row in flat]
        bound = max(1, (np.iinfo(np.int64).max // compressed) // 2)
        multipliers = [
            np.random.default_rng(10007 * layer).integers(0, bound, size=(self.order,), dtype=np.int64) * 2 + 1
            for layer in layers
        ]
        self.pad = int(token_map[int(get("engram_pad_token_id"))])
        self.register_buffer("token_map", torch.tensor(list(token_map), dtype=torch.long), persistent=False)
        self.register_buffer("primes", torch.tensor(flat, dtype=torch.long), persistent=False)
        self.register_buffer("offsets", torch.tensor(offsets, dtype=torch.long), persistent=False)
        self.register_buffer("multipliers", torch.tensor(np.stack(multipliers), dtype=torch.long), persistent=False)
        self.heads = len(flat[0]) // (self.order - 1)

    def forward(
        self,
        input_ids: torch.Tensor,
        sequence_ids: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
        cp_group: dist.ProcessGroup | None = None,
    ) -> torch.Tensor:
        """``input_ids`` ``[T]``: this rank's packed rows; ``sequence_ids`` ``[T]`` (0 = padding; default:
        one sequence), ``token_mask`` ``[T]`` bool (False: no Engram lookback through the row)."""
        if input_ids.ndim != 1:
            raise ValueError(f"EngramHasher takes packed rows [T], got shape {tuple(input_ids.shape)}.")
        if bool(((input_ids < 0) | (input_ids >= self.token_map.numel())).any()):
            raise ValueError(f"Engram input_ids must be token ids in [0, {self.token_map.numel()}).")
        rows, look = input_ids.shape[0], self.order - 1
        seq = torch.ones_like(input_ids) if sequence_ids is None else sequence_ids.long()
        valid = torch.ones_like(input_ids, dtype=torch.bool) if token_mask is None else token_mask.bool()
        here = torch.stack([self.token_map[input_ids.long()], seq, valid.long(), torch.ones_like(seq)], dim=1)
        if cp_group is not None and dist.get_world_size(cp_group) > 1:
            if rows < look:
                raise RuntimeError(
                    f"Engram under CP needs >= {look} rows per rank (engram_max_ngram_size - 1) to look back into "
                    f"the previous rank, got {rows}. Pad the packed batch to a larger multiple of the CP size."
                )
            before = exchange_left_halo(here, look, cp_group)  # rank 0: zeros, so 'present' = 0
        else:
            before = here.new_zeros(look, 4)
        grid = torch.cat([before, here], dim=0)  # row t of this rank is grid row t + look
        at = torch.arange(rows, device=input_ids.device) + look
        own_seq = grid[at, 1]
        usable = torch.ones(rows, dtype=torch.bool, device=input_ids.device)
        tokens = []
        for back in range(self.order):
            src = grid[at - back]
            usable = usable & (src[:, 3] == 1) & (src[:, 2] == 1) & (src[:, 1] == own_seq) & (own_seq != 0)
            tokens.append(torch.where(usable, src[:, 0], self.pad))
        products = torch.stack(tokens, dim=1).unsqueeze(1) * self.multipliers  # [T, layers, N]
        hashes, acc = [], products[..., 0]
        for n in range(1, self.order):
            acc = torch.bitwise_xor(acc, products[..., n])
            cols = slice((n - 1) * self.heads, n * self.heads)
            hashes.append(acc.unsqueeze(-1) % self.primes[:, cols])
        return torch.cat(hashes, dim=-1) + self.offsets


class DS41Engram(nn.Module):
    """One Engram layer (table, fused key/value projection, per-stream gate) on streams ``[T, n, h]``."""

    def __init__(self, hidden: int, hc_mult: int, hash_heads: int, head_dim: int, rows: int, eps: float, dtype=None):
        super().__init__()
        self.hidden, self.hc_mult, self.hash_heads, self.rows, self.eps = hidden, hc_mult, hash_heads, rows, eps
        self.multi_head_embedding = nn.Embedding(rows, head_dim, dtype=dtype)
        self.linear_kv_proj = nn.Linear(hash_heads * head_dim, (hc_mult + 1) * hidden, bias=False, dtype=dtype)
        self.query_norm = _StreamNormWeight(hc_mult, hidden, dtype)
        self.key_norm = _StreamNormWeight(hc_mult, hidden, dtype)

    @classmethod
    def from_config(cls, text: Any, layer: int, dtype=None) -> "DS41Engram":
        get = _getter(text)
        index = list(get("engram_layer_ids")).index(layer)
        return cls(
            hidden=int(get("hidden_size")), hc_mult=int(get("hc_mult")),
            hash_heads=(int(get("engram_max_ngram_size")) - 1) * int(get("engram_n_heads")),
            head_dim=int(get("engram_head_dim")), rows=int(get("engram_num_embeddings")[index]),
            eps=float(get("rms_norm_eps")), dtype=dtype,
        )  # fmt: skip

    def forward(self, streams: torch.Tensor, hash_rows: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``streams`` ``[T, n, h]``, ``hash_rows`` ``[T, heads]`` (this layer's rows), ``token_mask`` ``[T]``."""
        if streams.shape[-2:] != (self.hc_mult, self.hidden) or hash_rows.shape != (streams.shape[0], self.hash_heads):
            raise ValueError(
                f"DS41Engram expects streams [T, {self.hc_mult}, {self.hidden}] and hash_rows [T, {self.hash_heads}], "
                f"got {tuple(streams.shape)} and {tuple(hash_rows.shape)}."
            )
        memory = self.multi_head_embedding(hash_rows).flatten(-2)
        keys, value = self.linear_kv_proj(memory).split([self.hc_mult * self.hidden, self.hidden], dim=-1)
        keys = keys.unflatten(-1, (self.hc_mult, self.hidden))
        query = _rms(streams, self.eps) * self.query_norm.weight
        key = _rms(keys, self.eps) * self.key_norm.weight
        score = (query * key).sum(-1) / self.hidden**0.5  # [T, n]
        gate = torch.sigmoid(torch.copysign(score.abs().clamp_min(1e-6).sqrt(), score))
        if token_mask is not None:
            gate = gate * token_mask.to(gate.dtype).unsqueeze(-1)
        return streams + gate.unsqueeze(-1) * value.unsqueeze(-2)


class _StreamNormWeight(nn.Module):
    """A per-stream RMSNorm weight ``[n, h]`` (a module so the name reads ``query_norm.weight``)."""

    def __init__(self, n: int, hidden: int, dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n, hidden, dtype=dtype))


def _getter(text: Any):
    """Field reader of a text config (a ``config.json`` dict, nested or not, or a config object)."""
    text = ds41_facts.text_config(text)
    return (lambda k: text[k]) if isinstance(text, dict) else (lambda k: getattr(text, k))


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
