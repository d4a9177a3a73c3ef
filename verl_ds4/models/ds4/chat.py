"""DS4 chat encoding for SFT: verl's DS4 encoder plus assistant-only loss masks.

DeepSeek-V4 checkpoints ship no chat template. verl renders DS4 prompts with
:func:`verl.utils.tokenizer.deepseek.encode_messages` (a port of the encoder shipped with the model,
used by verl's rollout). SFT must produce the *same* text, so this module calls that encoder for the
whole conversation and only adds what SFT needs on top:

- :func:`validate_conversation` rejects a malformed row with an error naming the row;
- :func:`render_conversation` returns the text and the character spans the model is trained on;
- :func:`tokenize_conversation` turns that into token ids and a loss mask.

Which characters are trained: every assistant turn from the end of its header to its end-of-sentence
token, inclusive. The header is what a generation prompt contains: ``<｜Assistant｜>`` followed by
``</think>`` (chat mode) or ``<think>`` (thinking mode; the reasoning, ``</think>``, the answer and EOS
are then trained). After a quick-instruction ``task`` token the assistant text follows that token
directly, so the span starts after it. Spans are found by scanning the rendered text for DS4's
structural tokens, which is exact because :func:`validate_conversation` refuses any message text
that contains one of them.

Loss-mask convention (verl's SFT loss rolls the mask left by one inside the packed batch): mask[i]
is 1 when token i is a training target. Token 0 is never a target, so the roll never leaks a target
across packed sequence boundaries.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from verl.utils.tokenizer.deepseek import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    EOS_TOKEN,
    LATEST_REMINDER_TOKEN,
    TASK_TOKENS,
    THINK_END_TOKEN,
    THINK_START_TOKEN,
    USER_TOKEN,
    encode_messages,
)

SUPPORTED_ROLES = ("system", "developer", "user", "tool", "assistant", "latest_reminder")

# Tokens that delimit turns; message text containing one would corrupt the turn structure.
STRUCTURAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, LATEST_REMINDER_TOKEN, *TASK_TOKENS.values())

THINKING_MODES = {"thinking": True, "think": True, "chat": False, "non-thinking": False, "non_thinking": False}


class MalformedRowError(ValueError):
    """A dataset row cannot be rendered with DS4's chat encoding; the message names the row."""

    def __init__(self, row: Any, reason: str):
        self.row = row
        self.reason = reason
        super().__init__(
            f"DS4 SFT data row {row}: {reason} Fix the row, or set data.drop_malformed_rows=true to drop such rows "
            "(they are counted and logged)."
        )


@dataclass(frozen=True)
class RenderedConversation:
    """One conversation rendered with DS4's encoding.

    Attributes:
        text: the full prompt text (BOS first, no trailing generation prompt).
        spans: ``[start, end)`` character ranges that are training targets, in order.
    """

    text: str
    spans: tuple[tuple[int, int], ...]


def _is_missing(value: Any) -> bool:
    """None, a float NaN, or a pandas missing marker (pd.NA / NaT)."""
    if value is None or type(value).__name__ in ("NAType", "NaTType"):
        return True
    return isinstance(value, float) and math.isnan(value)


def resolve_thinking(enable_thinking: Any, thinking_mode: Any, default: Any, row: Any = None) -> bool:
    """Decide chat vs thinking mode for one row.

    Row values win over the dataset default; a row that sets both ``enable_thinking`` and
    ``thinking_mode`` must agree. ``default`` may be None or the string ``"none"`` (verl's config
    default), both meaning chat mode.
    """
    from_flag = None if _is_missing(enable_thinking) else bool(enable_thinking)
    from_mode = None
    if not _is_missing(thinking_mode):
        mode = str(thinking_mode).strip().lower()
        if mode not in THINKING_MODES:
            raise MalformedRowError(row, f"thinking_mode={thinking_mode!r} is not one of {sorted(THINKING_MODES)}.")
        from_mode = THINKING_MODES[mode]
    if from_flag is not None and from_mode is not None and from_flag != from_mode:
        raise MalformedRowError(
            row, f"enable_thinking={enable_thinking!r} contradicts thinking_mode={thinking_mode!r}."
        )
    if from_flag is not None:
        return from_flag
    if from_mode is not None:
        return from_mode
    if _is_missing(default) or (isinstance(default, str) and default.strip().lower() in ("none", "null", "")):
        return False
    if isinstance(default, str):
        return default.strip().lower() in ("true", "1", "yes", "thinking")
    return bool(default)


def _texts_of(message: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, text) pairs of everything a message contributes to the rendered text."""
    out: list[tuple[str, str]] = []
    content = message.get("content")
    if isinstance(content, str):
        out.append(("content", content))
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                out.append(("content", part["text"]))
    for key in ("reasoning_content", "reasoning"):
        if isinstance(message.get(key), str):
            out.append((key, message[key]))
    for call in message.get("tool_calls") or []:
        out.append(("tool_calls", json.dumps(call, ensure_ascii=False, default=str)))
    return out


def validate_conversation(messages: Any, tools: Any = None, row: Any = None) -> list[dict[str, Any]]:
    """Check one row's ``messages`` (and ``tools``) and return the messages as a list of dicts.

    Raises:
        MalformedRowError: naming ``row`` and the first problem found.
    """
    if not isinstance(messages, (list, tuple)) or len(messages) == 0:
        raise MalformedRowError(row, f"messages must be a non-empty list of dicts, got {type(messages).__name__}.")
    checked: list[dict[str, Any]] = []
    n_assistant = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise MalformedRowError(row, f"message {i} is a {type(message).__name__}, expected a dict with 'role'.")
        role = message.get("role")
        if role not in SUPPORTED_ROLES:
            raise MalformedRowError(row, f"message {i} has role {role!r}; DS4 supports {list(SUPPORTED_ROLES)}.")
        content = message.get("content")
        if not (content is None or isinstance(content, (str, list))):
            raise MalformedRowError(
                row, f"message {i} content is a {type(content).__name__}; expected a string or a list of text parts."
            )
        task = message.get("task")
        if not _is_missing(task) and task not in TASK_TOKENS:
            raise MalformedRowError(row, f"message {i} has task {task!r}; DS4 supports {sorted(TASK_TOKENS)}.")
        for field, text in _texts_of(message):
            for token in STRUCTURAL_TOKENS:
                if token in text:
                    raise MalformedRowError(
                        row,
                        f"message {i} ({role}) {field} contains the DS4 control token {token!r}, which would break "
                        "the turn structure.",
                    )
        if role == "assistant":
            n_assistant += 1
            has_text = any(field != "tool_calls" and text for field, text in _texts_of(message))
            if not has_text and not message.get("tool_calls"):
                raise MalformedRowError(row, f"message {i} (assistant) is empty: no content, reasoning or tool calls.")
        checked.append(dict(message))
    if n_assistant == 0:
        raise MalformedRowError(row, "has no assistant message, so there is nothing to train on.")
    if tools is not None and not isinstance(tools, (list, tuple)):
        raise MalformedRowError(row, f"tools must be a list of tool schemas, got {type(tools).__name__}.")
    return checked


def render_conversation(
    messages: Sequence[dict[str, Any]],
    tools: Optional[list[dict[str, Any]]] = None,
    *,
    enable_thinking: bool = False,
    drop_thinking: bool = True,
    reasoning_effort: Optional[str] = None,
    row: Any = None,
) -> RenderedConversation:
    """Render with verl's DS4 encoder and locate the assistant spans (see the module docstring)."""
    text = encode_messages(
        list(messages),
        tools=tools or None,
        add_generation_prompt=False,
        add_bos_token=True,
        enable_thinking=enable_thinking,
        drop_thinking=drop_thinking,
        reasoning_effort=reasoning_effort,
    )
    openers = [ASSISTANT_TOKEN + THINK_START_TOKEN, ASSISTANT_TOKEN + THINK_END_TOKEN, *TASK_TOKENS.values()]
    closers = [USER_TOKEN, LATEST_REMINDER_TOKEN]
    spans: list[tuple[int, int]] = []
    open_at: Optional[int] = None
    pos = 0
    while pos < len(text):
        if text.startswith(EOS_TOKEN, pos):
            end = pos + len(EOS_TOKEN)
            if open_at is None:
                raise MalformedRowError(row, "rendered an end-of-sentence token outside an assistant turn.")  # error-catalogue: internal: the renderer broke its own turn structure
            spans.append((open_at, end))
            open_at, pos = None, end
            continue
        for marker in openers:
            if text.startswith(marker, pos):
                open_at = pos = pos + len(marker)
                break
        else:
            for marker in closers:
                if text.startswith(marker, pos):
                    open_at, pos = None, pos + len(marker)
                    break
            else:
                pos += 1
    n_assistant = sum(1 for m in messages if m.get("role") == "assistant")
    if len(spans) != n_assistant:
        raise MalformedRowError(  # error-catalogue: internal: the renderer's spans disagree with its messages
            row, f"rendered {len(spans)} assistant spans for {n_assistant} assistant messages (unsupported layout)."
        )
    return RenderedConversation(text=text, spans=tuple(spans))


def tokenize_conversation(tokenizer: Any, rendered: RenderedConversation) -> tuple[list[int], list[int]]:
    """Token ids of ``rendered.text`` (one call, as rollout does) and the assistant-only loss mask.

    Fast tokenizers give character offsets, so the ids are exactly the whole-text ids. Slow
    tokenizers are tokenized span by span (every boundary sits right after a DS4 control token).
    """
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(rendered.text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = [0] * len(ids)
        spans = rendered.spans
        k = 0
        for t, (start, end) in enumerate(enc["offset_mapping"]):
            while k < len(spans) and start >= spans[k][1]:
                k += 1
            if k < len(spans) and spans[k][0] <= start < spans[k][1] and end > start:
                mask[t] = 1
    else:
        ids, mask, cursor = [], [], 0
        pieces: list[tuple[str, int]] = []
        for start, end in rendered.spans:
            pieces += [(rendered.text[cursor:start], 0), (rendered.text[start:end], 1)]
            cursor = end
        pieces.append((rendered.text[cursor:], 0))
        for piece, flag in pieces:
            if piece:
                piece_ids = tokenizer.encode(piece, add_special_tokens=False)
                ids += piece_ids
                mask += [flag] * len(piece_ids)
    if mask:
        mask[0] = 0
    return ids, mask
