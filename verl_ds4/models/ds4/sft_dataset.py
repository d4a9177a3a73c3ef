"""DS4 SFT dataset for verl's SFT trainer (``data.custom_cls``).

verl's ``MultiTurnSFTDataset`` renders with ``tokenizer.apply_chat_template``, which DS4 checkpoints
do not have. :class:`DS4ChatSFTDataset` takes the same constructor arguments and returns the same
items (``input_ids``, ``position_ids``, ``loss_mask``; plus ``attention_mask`` with right padding) but
renders each row with DS4's encoding (:mod:`verl_ds4.models.ds4.chat`) and trains on assistant
turns only.

Select it in the SFT config (the DS4 recipe does)::

    data.custom_cls.path=pkg://verl_ds4.models.ds4.sft_dataset
    data.custom_cls.name=DS4ChatSFTDataset

Columns: ``messages`` (list of OpenAI-style messages; key from ``data.messages_key``), optional
``tools`` (list of schemas or a JSON string; ``data.tools_key``), optional per-row
``enable_thinking`` (bool; ``data.enable_thinking_key``) / ``thinking_mode`` ("chat" or "thinking";
``data.thinking_mode_key``) / ``reasoning_effort``. Options: ``data.enable_thinking_default``,
``data.drop_thinking`` (default true), ``data.reasoning_effort``, ``data.max_length``,
``data.truncation`` (error | left | right), ``data.pad_mode`` (no_padding | right),
``data.drop_malformed_rows`` (default false), ``data.drop_overlong_rows`` (default false).

Every row is tokenized when the dataset is built and the rows longer than ``data.max_length`` are counted
(printed at start-up): with ``data.drop_overlong_rows=true`` they are dropped, with ``data.truncation=error`` (the
default) the dataset refuses to build naming their count, with ``left`` / ``right`` they are cut when read.

Every row is checked when the dataset is built, so a malformed row fails before training starts
with an error that names it. With ``drop_malformed_rows=true`` such rows are dropped instead, and
their count and first reasons are logged at WARNING level.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Optional

import numpy as np
import pandas as pd
import torch
from torch.utils.data import Dataset

from verl_ds4.models.ds4.chat import (
    MalformedRowError,
    _is_missing,
    render_conversation,
    resolve_thinking,
    tokenize_conversation,
    validate_conversation,
)

logger = logging.getLogger(__name__)


def _to_python(value: Any) -> Any:
    """Parquet/numpy containers -> plain lists and dicts (recursively)."""
    if isinstance(value, np.ndarray):
        return [_to_python(v) for v in value.tolist()]
    if isinstance(value, (list, tuple)):
        return [_to_python(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_python(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return value


class DS4ChatSFTDataset(Dataset):
    """Multi-turn SFT rows rendered with DS4's chat encoding, loss on assistant turns only.

    Args:
        parquet_files: one path or a list of paths (local, or anything verl can copy locally).
        tokenizer: a tokenizer (or a path for verl's ``hf_tokenizer``); a fast tokenizer is preferred.
        config: the ``data`` config block (see the module docstring for the keys read).
        processor: unused (DS4 is text-only); accepted for verl's constructor signature.
        max_samples: keep at most this many rows (-1: all).
    """

    def __init__(
        self,
        parquet_files: str | list[str],
        tokenizer: Any,
        config: Any = None,
        processor: Any = None,
        max_samples: int = -1,
    ):
        config = config or {}
        get = config.get
        self.messages_key = get("messages_key", "messages")
        self.tools_key = get("tools_key", "tools")
        self.enable_thinking_key = get("enable_thinking_key", "enable_thinking")
        self.thinking_mode_key = get("thinking_mode_key", "thinking_mode")
        self.reasoning_effort_key = get("reasoning_effort_key", "reasoning_effort")
        self.enable_thinking_default = get("enable_thinking_default", None)
        self.drop_thinking = bool(get("drop_thinking", True))
        self.reasoning_effort = get("reasoning_effort", None)
        self.max_length = int(get("max_length", 1024))
        self.truncation = get("truncation", "error")
        self.pad_mode = get("pad_mode", "no_padding")
        self.drop_malformed_rows = bool(get("drop_malformed_rows", False))
        self.drop_overlong_rows = bool(get("drop_overlong_rows", False))
        self.shuffle = bool(get("shuffle", False))
        self.seed = get("seed", None)
        if self.truncation not in ("error", "left", "right"):
            raise ValueError(f"data.truncation={self.truncation!r}; expected 'error', 'left' or 'right'.")
        if self.pad_mode not in ("no_padding", "right"):
            raise ValueError(f"data.pad_mode={self.pad_mode!r}; expected 'no_padding' or 'right'.")
        if isinstance(tokenizer, str):
            from verl.utils import hf_tokenizer

            tokenizer = hf_tokenizer(tokenizer)
        self.tokenizer = tokenizer
        self.processor = processor
        if isinstance(parquet_files, str) or not hasattr(parquet_files, "__iter__"):
            parquet_files = [parquet_files]
        self.parquet_files = [str(p) for p in parquet_files]
        self._load(max_samples)

    def _load(self, max_samples: int) -> None:
        from verl.utils.fs import copy_local_path_from_hdfs

        frames = [pd.read_parquet(copy_local_path_from_hdfs(p, verbose=False)) for p in self.parquet_files]
        df = pd.concat(frames, ignore_index=True)
        if self.messages_key not in df.columns:
            raise ValueError(
                f"DS4 SFT data {self.parquet_files} has no {self.messages_key!r} column (columns: {list(df.columns)}); "
                "set data.messages_key or prepare the data with scripts/prepare_gsm8k.py."
            )
        total = len(df)
        if 0 < max_samples < total:
            if self.shuffle:
                rng = np.random.default_rng(*(() if self.seed is None else (self.seed,)))
                df = df.iloc[sorted(rng.choice(total, size=max_samples, replace=False).tolist())]
            else:
                df = df.iloc[:max_samples]
        rows: list[dict[str, Any]] = []
        dropped: list[str] = []
        for position, (index, record) in enumerate(df.iterrows()):
            row_name = f"{position} (file row index {index})"
            try:
                rows.append(self._prepare_row(record, row_name))
            except MalformedRowError as e:
                if not self.drop_malformed_rows:
                    raise
                dropped.append(str(e.reason) + f" [row {e.row}]")
        if dropped:
            logger.warning(
                "DS4ChatSFTDataset dropped %d of %d rows as malformed (data.drop_malformed_rows=true). First: %s",
                len(dropped),
                len(df),
                "; ".join(dropped[:5]),
            )
        if not rows:
            raise ValueError(f"DS4 SFT data {self.parquet_files}: no usable rows ({len(dropped)} dropped as malformed).")
        self.rows = rows
        self.num_dropped = len(dropped)
        self.dropped_reasons = dropped
        self._check_lengths()

    def _check_lengths(self) -> None:
        """Count the rows longer than ``data.max_length`` at start-up (printed): drop them with
        ``data.drop_overlong_rows=true``, refuse them with ``data.truncation=error``, else say they are truncated."""
        lengths = [len(self.encode(i)[0]) for i in range(len(self.rows))]
        over = [i for i, n in enumerate(lengths) if n > self.max_length]
        self.num_rows, self.num_overlong, self.longest = len(lengths), len(over), max(lengths)
        self.num_overlong_dropped = 0
        head = (f"DS4ChatSFTDataset: {len(over)} of {len(lengths)} rows are longer than data.max_length={self.max_length} "
                f"tokens (longest {self.longest})")
        if over and self.drop_overlong_rows:
            if len(over) == len(lengths):
                raise ValueError(f"{head}: data.drop_overlong_rows=true would drop them all. Fix: raise ds4.max_seq_len "
                                 "(launcher MAX_SEQ_LEN) or data.max_length.")
            dropped = set(over)
            self.rows = [r for i, r in enumerate(self.rows) if i not in dropped]
            self.num_overlong_dropped = len(over)
            print(f"{head}: dropped them (data.drop_overlong_rows=true); {len(self.rows)} left.", flush=True)
            return
        if over and self.truncation == "error":
            raise ValueError(
                f"{head}, with data.truncation=error (first: rows {over[:5]}). Fix: raise ds4.max_seq_len (launcher "
                "MAX_SEQ_LEN) or data.max_length, set data.drop_overlong_rows=true (drop them, counted) or "
                "data.truncation=left|right (cut them)."
            )
        print(head + (f": each is cut to its {'last' if self.truncation == 'left' else 'first'} {self.max_length} tokens "
                      f"(data.truncation={self.truncation})." if over else "."), flush=True)

    def _prepare_row(self, record: Any, row_name: str) -> dict[str, Any]:
        messages = _to_python(record[self.messages_key])
        tools = _to_python(record[self.tools_key]) if self.tools_key in record.index else None
        if isinstance(tools, str):
            try:
                tools = json.loads(tools) if tools.strip() else None
            except json.JSONDecodeError as e:
                raise MalformedRowError(row_name, f"tools is a string but not valid JSON ({e}).") from e
        if _is_missing(tools) or tools == []:
            tools = None
        messages = validate_conversation(messages, tools, row=row_name)
        enable = record[self.enable_thinking_key] if self.enable_thinking_key in record.index else None
        mode = record[self.thinking_mode_key] if self.thinking_mode_key in record.index else None
        thinking = resolve_thinking(enable, mode, self.enable_thinking_default, row=row_name)
        effort = record[self.reasoning_effort_key] if self.reasoning_effort_key in record.index else None
        effort = self.reasoning_effort if _is_missing(effort) else str(effort)
        row = {"messages": messages, "tools": tools, "enable_thinking": thinking, "reasoning_effort": effort}
        # Render once now so a row the encoder cannot handle fails at start-up, not mid-epoch.
        self._render(row, row_name)
        return row

    def _render(self, row: dict[str, Any], row_name: Any):
        return render_conversation(
            row["messages"],
            row["tools"],
            enable_thinking=row["enable_thinking"],
            drop_thinking=self.drop_thinking,
            reasoning_effort=row["reasoning_effort"],
            row=row_name,
        )

    def __len__(self) -> int:
        return len(self.rows)

    def encode(self, item: int) -> tuple[list[int], list[int]]:
        """Token ids and loss mask of row ``item`` before truncation and padding."""
        return tokenize_conversation(self.tokenizer, self._render(self.rows[item], item))

    def __getitem__(self, item: int) -> dict[str, torch.Tensor]:
        ids, mask = self.encode(item)
        input_ids = torch.tensor(ids, dtype=torch.long)
        loss_mask = torch.tensor(mask, dtype=torch.long)
        length = input_ids.shape[0]
        if length > self.max_length:
            if self.truncation == "error":
                raise ValueError(
                    f"DS4 SFT row {item} has {length} tokens, more than data.max_length={self.max_length}. "
                    "Raise data.max_length or set data.truncation=left|right."
                )
            keep = slice(-self.max_length, None) if self.truncation == "left" else slice(0, self.max_length)
            input_ids, loss_mask = input_ids[keep], loss_mask[keep].clone()
            # Token 0 has nothing before it to predict it from; keeps the packed roll leak-free.
            loss_mask[0] = 0
            length = self.max_length
        position_ids = torch.arange(length, dtype=torch.long)
        if self.pad_mode == "no_padding":
            return {"input_ids": input_ids, "position_ids": position_ids, "loss_mask": loss_mask}
        pad = self.max_length - length
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        return {
            "input_ids": torch.cat([input_ids, torch.full((pad,), pad_id, dtype=torch.long)]),
            "attention_mask": torch.cat([torch.ones(length, dtype=torch.long), torch.zeros(pad, dtype=torch.long)]),
            "position_ids": torch.cat([position_ids, torch.zeros(pad, dtype=torch.long)]),
            "loss_mask": torch.cat([loss_mask, torch.zeros(pad, dtype=torch.long)]),
        }


def build_dataset(
    parquet_files: str | list[str], tokenizer: Any, config: Optional[dict[str, Any]] = None, max_samples: int = -1
) -> DS4ChatSFTDataset:
    """Convenience constructor with a plain dict config."""
    return DS4ChatSFTDataset(parquet_files, tokenizer, config or {}, None, max_samples)
