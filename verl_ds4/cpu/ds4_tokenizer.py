"""A tiny word-level tokenizer with DS4's control tokens, built in memory (no hub download).

For CPU tests of the DS4 chat encoding: every DS4 control token (BOS, EOS, user / assistant /
reminder markers, ``<think>`` / ``</think>``, quick-instruction task tokens) is one added token, and
other text splits into words and punctuation (``tokenizers`` ``Whitespace`` pre-tokenizer), each
word one id from the given vocabulary. The real DS4 tokenizer is byte-level BPE; what matters for
the tests is that control tokens are atomic, which holds for both.
"""

from __future__ import annotations

from typing import Iterable

from verl.utils.tokenizer.deepseek import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    EOS_TOKEN,
    LATEST_REMINDER_TOKEN,
    TASK_TOKENS,
    THINK_END_TOKEN,
    THINK_START_TOKEN,
    USER_TOKEN,
)

PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"
DS4_CONTROL_TOKENS = (
    BOS_TOKEN,
    EOS_TOKEN,
    USER_TOKEN,
    ASSISTANT_TOKEN,
    LATEST_REMINDER_TOKEN,
    THINK_START_TOKEN,
    THINK_END_TOKEN,
    *TASK_TOKENS.values(),
)


def ds4_test_vocab(words: Iterable[str]) -> list[str]:
    """Vocabulary order used by :func:`make_ds4_test_tokenizer`: pad, unk, control tokens, words."""
    vocab = [PAD_TOKEN, UNK_TOKEN, *DS4_CONTROL_TOKENS]
    for word in words:
        if word not in vocab:
            vocab.append(word)
    return vocab


def make_ds4_test_tokenizer(words: Iterable[str]):
    """A ``PreTrainedTokenizerFast`` whose id of token ``t`` is ``ds4_test_vocab(words).index(t)``."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = ds4_test_vocab(words)
    core = Tokenizer(models.WordLevel({tok: i for i, tok in enumerate(vocab)}, unk_token=UNK_TOKEN))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.add_special_tokens([AddedToken(t, normalized=False) for t in (PAD_TOKEN, UNK_TOKEN, *DS4_CONTROL_TOKENS)])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
    )
