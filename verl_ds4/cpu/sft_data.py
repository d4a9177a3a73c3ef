"""Deterministic, download-free SFT assets for the CPU main job.

* :func:`arithmetic_conversations` - a few hundred short chat conversations (integer
  arithmetic questions and their answers), a pure function of ``(n, seed)``.
* :func:`digit_conversations` - demonstrations of the CPU RL task (``"Repeat the digit 7."`` ->
  ``"7777"``, :data:`DIGIT_PROMPT`, the prompt :mod:`verl_ds4.rollout.demo_task` asks), for the SFT
  that starts the RL learning benchmark (``task="digits"``).
* :func:`long_conversations` - arithmetic Q/A turns packed into conversations of at most ``seq_len`` tokens each
  (``task="long"``, the launcher's ``TASK=long MAX_SEQ_LEN=N``; counted by :func:`token_count` with DS4's chat
  encoding), for the CPU job at length (:mod:`verl_ds4.cpu.long_data` checks the length).
* :func:`write_sft_parquet` - verl's SFT format: a parquet file with a ``messages`` column.
* :func:`build_char_tokenizer` - a character-level ``PreTrainedTokenizerFast`` (HF
  ``tokenizers`` WordLevel model over single characters) with a tiny chat template; built
  from a fixed alphabet, so the same ids on every machine.
* :func:`write_model_dir` - a local "model path" for verl: the tokenizer plus an HF
  ``config.json`` (a tiny Llama-shaped config for the dense stepping stone; callers can
  write any other config, e.g. the DS4 proxy's).
* :func:`prepare_cpu_sft_assets` - the CPU jobs' folder: for ``model="ds4"`` (the default) a real
  DS4 checkpoint folder (tiny ``DeepseekV4Config``, safetensors of a seeded init, the tokenizer:
  :mod:`verl_ds4.cpu.ds4_model_dir`); ``ds4_proxy`` (attention-only proxy) and ``tiny_dense``
  write a config and the tokenizer only (seeded init in the engine); ``ds41`` a tiny DeepSeek-V4.1
  folder in our names (config.json, model.safetensors of a seeded init, the tokenizer whose
  normalisation tables Engram hashes: :mod:`verl_ds4.cpu.ds41_model_dir`).

verl reads all of it through its normal code paths (``HFModelConfig`` loads the tokenizer
and config from the folder, ``MultiTurnSFTDataset`` applies the chat template).
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path
from typing import Any, Iterable

__all__ = [
    "ALPHABET",
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "arithmetic_conversations",
    "DIGIT_PROMPT",
    "SFT_TASKS",
    "build_char_tokenizer",
    "digit_conversations",
    "long_conversations",
    "token_count",
    "ds4_control_tokens",
    "ds4_proxy_hf_config",
    "padded_vocab_size",
    "tokenizer_size",
    "model_hf_config",
    "prepare_cpu_sft_assets",
    "tiny_llama_config",
    "write_cpu_model_folder",
    "write_model_dir",
    "write_sft_parquet",
]

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def ds4_control_tokens() -> list[str]:
    """DS4's chat control tokens as verl's DS4 encoder writes them (each one atomic token)."""
    from verl_ds4.cpu.ds4_tokenizer import DS4_CONTROL_TOKENS

    return list(DS4_CONTROL_TOKENS)

# Every character the conversations use (checked when the tokenizer is built).
ALPHABET = string.ascii_letters + string.digits + " \n.,:;?!+-*/=()'\""

# One turn = <|role|> content <|end|>. The generation prompt is the bare <|assistant|>, so
# verl's MultiTurnSFTDataset masks it out of the loss and trains on content + <|end|>.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

_OPS = {
    "+": ("plus", lambda a, b: a + b),
    "-": ("minus", lambda a, b: a - b),
    "*": ("times", lambda a, b: a * b),
}


def arithmetic_conversations(n: int = 400, seed: int = 0) -> list[list[dict[str, str]]]:
    """``n`` conversations, each 2 or 4 turns of integer arithmetic Q/A (deterministic)."""
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    rng = random.Random(seed)
    conversations = []
    for _ in range(n):
        turns = []
        for _turn in range(rng.choice((1, 1, 2))):
            op = rng.choice(sorted(_OPS))
            word, fn = _OPS[op]
            a, b = rng.randint(0, 99), rng.randint(0, 20 if op == "*" else 99)
            style = rng.randrange(3)
            if style == 0:
                question = f"What is {a} {op} {b}?"
            elif style == 1:
                question = f"Compute {a} {word} {b}."
            else:
                question = f"{a} {op} {b} = ?"
            turns.append({"role": "user", "content": question})
            turns.append({"role": "assistant", "content": f"{a} {op} {b} = {fn(a, b)}."})
        conversations.append(turns)
    return conversations


#: The CPU RL task's prompt (verl_ds4.rollout.demo_task asks it; the SFT "digits" task demonstrates it).
DIGIT_PROMPT = "Repeat the digit {digit}."
#: The SFT datasets: arithmetic chats (the main job), the RL task's demonstrations, or arithmetic turns packed into
#: conversations of up to ``seq_len`` tokens (``long``: :func:`long_conversations`).
SFT_TASKS = ("arithmetic", "digits", "long")


def digit_conversations(n: int = 400, seed: int = 0, min_repeat: int = 3, max_repeat: int = 6) -> list[list[dict[str, str]]]:
    """``n`` demonstrations of the RL task: the asked digit repeated ``min_repeat..max_repeat`` times
    (deterministic in ``(n, seed)``)."""
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    if not 1 <= min_repeat <= max_repeat:
        raise ValueError(f"need 1 <= min_repeat <= max_repeat, got {min_repeat}, {max_repeat}")
    rng = random.Random(seed)
    conversations = []
    for _ in range(n):
        digit = str(rng.randrange(10))
        conversations.append([
            {"role": "user", "content": DIGIT_PROMPT.format(digit=digit)},
            {"role": "assistant", "content": digit * rng.randint(min_repeat, max_repeat)},
        ])
    return conversations


def token_count(tokenizer: Any, messages: list[dict[str, str]]) -> int:
    """Tokens of ``messages`` as the SFT dataset encodes them (DS4's chat encoding, BOS included)."""
    from verl_ds4.models.ds4.chat import render_conversation, tokenize_conversation

    return len(tokenize_conversation(tokenizer, render_conversation(messages))[0])


def long_conversations(n: int, seq_len: int, tokenizer: Any, seed: int = 0) -> list[list[dict[str, str]]]:
    """``n`` conversations of arithmetic Q/A turns, each filled with turns while it stays within ``seq_len``
    tokens (deterministic in ``(n, seq_len, seed)``). Every returned conversation has at most ``seq_len``
    tokens; a ``seq_len`` too short for one Q/A turn is an error."""
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    # A pool of single Q/A pairs, drawn in a seeded order.
    pairs = [turns[i:i + 2] for turns in arithmetic_conversations(max(64, n * 8), seed=seed) for i in range(0, len(turns), 2)]
    rng = random.Random(seed + 1)
    pair_cost = max(token_count(tokenizer, p) for p in pairs[:64])
    conversations = []
    for _ in range(n):
        conv: list[dict[str, str]] = []
        used = token_count(tokenizer, [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]) - 2
        while True:
            pair = pairs[rng.randrange(len(pairs))]
            if used + 2 * pair_cost <= seq_len:  # far from the end: add without re-encoding the whole row
                conv += pair
                used = token_count(tokenizer, conv) if len(conv) % 64 == 0 else used + token_count(tokenizer, pair) - 1
                continue
            if token_count(tokenizer, conv + pair) > seq_len:
                break
            conv += pair
            used = token_count(tokenizer, conv)
        while conv and token_count(tokenizer, conv) > seq_len:  # the running count is an estimate: trim to the length
            conv = conv[:-2]
        if not conv:
            raise ValueError(f"seq_len={seq_len}: shorter than one Q/A turn ({pair_cost} tokens); give MAX_SEQ_LEN >= {pair_cost}")
        conversations.append(conv)
    return conversations


def write_sft_parquet(path: str | Path, conversations: list[list[dict[str, str]]]) -> Path:
    """Write ``conversations`` as verl SFT parquet (one ``messages`` list per row)."""
    import pandas as pd

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame({"messages": conversations}).to_parquet(path, index=False)
    return path


def build_char_tokenizer():
    """A character-level fast tokenizer with :data:`SPECIAL_TOKENS` and :data:`CHAT_TEMPLATE`.

    DS4's control tokens (:func:`ds4_control_tokens`) are atomic special tokens too, so the same
    tokenizer serves verl's ``MultiTurnSFTDataset`` (chat template) and verl-ds4's
    ``DS4ChatSFTDataset`` (DS4 chat encoding). Ids: :data:`SPECIAL_TOKENS`, then
    :data:`ALPHABET` characters, then the DS4 control tokens.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ds4_tokens = ds4_control_tokens()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in ALPHABET:
        vocab.setdefault(ch, len(vocab))
    for tok_str in ds4_tokens:
        vocab.setdefault(tok_str, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=[*SPECIAL_TOKENS[4:], *ds4_tokens],
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def padded_vocab_size(n_tokens: int) -> int:
    """The tokenizer size rounded up to a multiple of 8 (the model's embedding rows)."""
    return -(-n_tokens // 8) * 8


def tokenizer_size() -> int:
    """Number of tokens of :func:`build_char_tokenizer`."""
    return len(build_char_tokenizer())


def tiny_llama_config(vocab_size: int, **overrides: Any):
    """A tiny Llama-shaped HF config (the dense CPU stepping-stone model)."""
    from transformers import LlamaConfig

    settings = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        architectures=["LlamaForCausalLM"],
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


#: What the proxy's config.json says about itself (it is not a loadable DeepSeek-V4 checkpoint).
DS4_PROXY_NOTE = (
    "verl-ds4 attention-only DS4 proxy, not a DeepSeek-V4: DS4 hybrid attention (the layer_types, "
    "compress_rates and compress RoPE/YaRN below) in a Megatron-Core GPTModel with a dense SwiGLU MLP of "
    "ffn_hidden_size; no mHC (hc_mult 1 here), no MoE (the expert fields describe one dense MLP), no hash "
    "layers, no SwiGLU clamp (swiglu_limit is unused). Its sizes are verl_ds4_proxy; transformers cannot load it as DeepseekV4ForCausalLM."
)

_RATIO_TO_LAYER_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention"}


def ds4_proxy_hf_config(vocab_size: int | None = None, proxy_sizes: dict | None = None):
    """An HF ``DeepseekV4Config`` (``model_type="deepseek_v4"``) that says it is the attention-only proxy.

    The proxy's own sizes (``verl_ds4/models/ds4/configs/tiny_proxy.json`` unless
    ``proxy_sizes`` is given) travel in the attribute ``verl_ds4_proxy``, which the CPU engine's
    ``deepseek_v4`` builder reads; the standard HF fields describe what the proxy has (its layer
    types, compression rates, RoPE / YaRN, window, indexer) so verl's config readers (tokenizer
    ids, FLOP counter, MTP switch) see the same small model, and ``verl_ds4_note`` says what it
    lacks (:data:`DS4_PROXY_NOTE`: no mHC, no MoE). MTP is off.
    """
    from transformers import DeepseekV4Config

    from verl_ds4.models.ds4.proxy import load_proxy_config

    sizes = load_proxy_config(proxy_sizes)
    vocab_size = sizes["vocab_size"] if vocab_size is None else vocab_size
    if vocab_size > sizes["vocab_size"]:
        if proxy_sizes is not None:
            raise ValueError(f"vocab_size={vocab_size} exceeds the given proxy vocab_size={sizes['vocab_size']}.")
        sizes["vocab_size"] = vocab_size  # the packaged proxy grows its embedding to the tokenizer
    config = DeepseekV4Config(
        vocab_size=vocab_size,
        hidden_size=sizes["hidden_size"],
        moe_intermediate_size=sizes["ffn_hidden_size"],
        num_hidden_layers=len(sizes["compress_ratios"]),
        num_attention_heads=sizes["num_attention_heads"],
        num_key_value_heads=1,
        head_dim=sizes["head_dim"],
        qk_rope_head_dim=sizes["rope_dim"],
        q_lora_rank=sizes["q_lora_rank"],
        o_groups=sizes["o_groups"],
        o_lora_rank=sizes["o_lora_rank"],
        sliding_window=sizes["window_size"],
        index_n_heads=sizes["index_n_heads"],
        index_head_dim=sizes["index_head_dim"],
        index_topk=sizes["index_topk"],
        layer_types=[_RATIO_TO_LAYER_TYPE.get(r, "heavily_compressed_attention") for r in sizes["compress_ratios"]],
        compress_rates={"compressed_sparse_attention": 4, **{"heavily_compressed_attention": r for r in sizes["compress_ratios"] if r > 4}},
        mlp_layer_types=["moe"] * len(sizes["compress_ratios"]),
        n_routed_experts=1,
        num_experts_per_tok=1,
        n_shared_experts=0,
        hc_mult=1,
        rms_norm_eps=sizes.get("norm_epsilon", 1e-6),
        num_nextn_predict_layers=0,
        max_position_embeddings=sizes.get("max_sequence_length", 8192),
        rope_theta=sizes.get("rope_theta", 10000.0),
        compress_rope_theta=sizes.get("compress_rope_theta", 160000.0),
        rope_parameters={
            "rope_type": "yarn",
            "factor": sizes["yarn_factor"],
            "original_max_position_embeddings": sizes["yarn_original_max_position_embeddings"],
            "beta_fast": sizes["yarn_beta_fast"],
            "beta_slow": sizes["yarn_beta_slow"],
        },
        tie_word_embeddings=False,
        architectures=["DeepseekV4ForCausalLM"],
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    config.verl_ds4_proxy = {k: v for k, v in sizes.items() if not k.startswith("_")}
    config.verl_ds4_note = DS4_PROXY_NOTE
    return config


def write_model_dir(out_dir: str | Path, hf_config=None) -> Path:
    """Write tokenizer files and ``config.json`` into ``out_dir`` (a verl ``model.path``).

    ``hf_config`` defaults to :func:`tiny_llama_config` sized to the tokenizer (vocab rounded
    up to a multiple of 8). A config whose ``vocab_size`` is smaller than the tokenizer is an
    error.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer()
    n_tokens = len(tokenizer)
    if hf_config is None:
        hf_config = tiny_llama_config(vocab_size=padded_vocab_size(n_tokens))
    if hf_config.vocab_size < n_tokens:
        raise ValueError(f"hf_config.vocab_size={hf_config.vocab_size} < tokenizer size {n_tokens}; raise vocab_size.")
    tokenizer.save_pretrained(out_dir)
    hf_config.save_pretrained(out_dir)
    return out_dir


#: ds4: the full tiny DeepSeek-V4 (default); ds4_proxy: the attention-only proxy; tiny_dense: Llama-shaped;
#: ds41: the tiny DeepSeek-V4.1 (CSA2, Engram, single-pass mHC; no DSpark drafter).
MODELS = ("ds4", "ds4_proxy", "tiny_dense", "ds41")
#: The module that registers each model's CPU builder; verl imports it via ``model.external_lib``.
MODEL_EXTERNAL_LIBS = {"ds4": "verl_ds4.cpu.ds4_builder", "ds4_proxy": "verl_ds4.cpu.ds4_builder",
                       "tiny_dense": "verl_ds4.cpu.tiny_dense", "ds41": "verl_ds4.cpu.ds41_builder"}


def model_hf_config(model: str):
    """The HF config of a CPU demo model: ``ds4`` (the full tiny DS4), ``ds4_proxy`` (attention-only
    proxy) or ``tiny_dense`` (Llama-shaped)."""
    vocab = padded_vocab_size(tokenizer_size())
    if model == "ds4":
        from verl_ds4.cpu.ds4_model_dir import ds4_tiny_hf_config

        return ds4_tiny_hf_config(vocab_size=vocab)
    if model == "ds4_proxy":
        return ds4_proxy_hf_config(vocab_size=vocab)
    if model == "tiny_dense":
        return tiny_llama_config(vocab_size=vocab)
    if model == "ds41":  # a config.json dict (transformers 5.10.4 has no deepseek_v41)
        from verl_ds4.cpu.ds41_model_dir import ds41_tiny_config

        # vocab_size = the tokenizer's ids, unpadded: Engram hashes only ids its tokenizer has, and a
        # rollout sampling from padded rows would feed it ids it cannot normalise.
        tokenizer = build_char_tokenizer()
        return ds41_tiny_config(vocab_size=len(tokenizer), tokenizer=tokenizer)
    raise ValueError(f"model={model!r}; expected one of {MODELS}.")


def write_cpu_model_folder(model_dir: str | Path, model: str, max_positions: int | None = None,
                           family: str = "transformers") -> Path:
    """The CPU jobs' model folder for ``model`` (one of :data:`MODELS`): the tokenizer, the config and, for
    ``ds4`` and ``ds41``, the seeded weights. ``max_positions``: the config's ``max_position_embeddings`` instead
    of the tiny model's own (a size of our choosing; no weight or RoPE value reads it). ``family``: the ``ds4``
    weights' tensor names (``"native"``: DeepSeek's, which Megatron-Bridge reads)."""
    hf_config = model_hf_config(model)
    if max_positions is not None:
        if isinstance(hf_config, dict):
            hf_config["max_position_embeddings"] = int(max_positions)
        else:
            hf_config.max_position_embeddings = int(max_positions)
    if model == "ds41":
        from verl_ds4.cpu.ds41_model_dir import write_ds41_weights

        model_dir = Path(model_dir)
        model_dir.mkdir(parents=True, exist_ok=True)
        build_char_tokenizer().save_pretrained(model_dir)  # first: Engram's tables come from tokenizer.json
        write_ds41_weights(model_dir, hf_config)
        return model_dir
    model_dir = write_model_dir(model_dir, hf_config=hf_config)
    if model == "ds4":
        from verl_ds4.cpu.ds4_model_dir import write_ds4_weights

        write_ds4_weights(model_dir, hf_config, family=family)
    return model_dir


def prepare_cpu_sft_assets(
    out_dir: str | Path, *, model: str = "ds4", n_train: int = 400, n_val: int = 0, seed: int = 0, task: str = "arithmetic",
    seq_len: int | None = None, max_positions: int | None = None,
) -> dict[str, str]:
    """Create ``model/`` (tokenizer + HF config; for ``ds4`` also the weights) and ``data/train.parquet``.

    ``task``: ``arithmetic`` (:func:`arithmetic_conversations`, the main job) or ``digits``
    (:func:`digit_conversations`, the RL task's demonstrations) or ``long`` (arithmetic turns packed into rows of at
    most ``seq_len`` tokens, :func:`long_conversations`). ``max_positions``: the model
    config's ``max_position_embeddings`` (:func:`write_cpu_model_folder`).

    Returns strings: ``model``, ``train``, (if ``n_val``) ``val``, and ``external_lib`` (the
    module to pass as verl's ``model.external_lib`` so the CPU engine can build the model).
    The files are a pure function of the arguments: a folder that an earlier call with the same
    arguments completed (its ``assets.json``) is reused as it is (a resumed or repeated run starts
    ~15 s sooner); other arguments rewrite it.
    """
    out_dir = Path(out_dir)
    if model not in MODELS:
        raise ValueError(f"model={model!r}; expected one of {MODELS}.")
    if task not in SFT_TASKS:
        raise ValueError(f"task={task!r}; expected one of {SFT_TASKS}.")
    if task == "long" and not seq_len:
        raise ValueError("task='long' needs seq_len (the launcher's MAX_SEQ_LEN), e.g. MAX_SEQ_LEN=16384 TASK=long")
    recorded = {"model": model, "task": task, "n_train": n_train, "n_val": n_val, "seed": seed}
    if task == "long":
        recorded["seq_len"] = int(seq_len)
    if max_positions is not None:
        recorded["max_positions"] = int(max_positions)
    files = {"model": str(out_dir / "model"), "train": str(out_dir / "data" / "train.parquet")}
    if n_val:
        files["val"] = str(out_dir / "data" / "val.parquet")
    paths = {"external_lib": MODEL_EXTERNAL_LIBS[model], **files}
    if reuse_assets(out_dir, recorded, files.values()):
        return paths
    write_cpu_model_folder(out_dir / "model", model, max_positions)
    if task == "long":
        conversations = long_conversations(n_train + n_val, int(seq_len), build_char_tokenizer(), seed=seed)
    else:
        make = arithmetic_conversations if task == "arithmetic" else digit_conversations
        conversations = make(n_train + n_val, seed=seed)
    used = {ch for conv in conversations for turn in conv for ch in turn["content"]}
    unknown = used - set(ALPHABET)
    if unknown:
        raise ValueError(f"conversation characters missing from ALPHABET: {sorted(unknown)}")
    write_sft_parquet(out_dir / "data" / "train.parquet", conversations[:n_train])
    if n_val:
        write_sft_parquet(out_dir / "data" / "val.parquet", conversations[n_train:])
    record_assets(out_dir, recorded)
    return paths


ASSETS_RECORD = "assets.json"


def reuse_assets(out_dir: Path, recorded: dict[str, Any], files: Iterable[str]) -> bool:
    """True when ``out_dir``'s record (:data:`ASSETS_RECORD`) holds ``recorded`` and every one of ``files``
    exists: an earlier write with these arguments completed, and the assets are a pure function of them.
    Otherwise the record is removed (:func:`record_assets` writes it again last, so a write interrupted
    from here on is not taken for a complete one) and False is returned."""
    record = Path(out_dir) / ASSETS_RECORD
    if record.is_file() and json.loads(record.read_text()) == recorded and all(Path(f).exists() for f in files):
        return True
    record.unlink(missing_ok=True)
    return False


def record_assets(out_dir: Path, recorded: dict[str, Any]) -> None:
    """Mark ``out_dir``'s assets complete for the arguments ``recorded`` (after the last file is written)."""
    (Path(out_dir) / ASSETS_RECORD).write_text(json.dumps(recorded) + "\n")


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m verl_ds4.cpu.sft_data",
        description="Write the CPU demo's model folder (char tokenizer + HF config) and an SFT parquet (arithmetic chats or the RL task's demonstrations).",
    )
    parser.add_argument("--out", required=True, help="output folder (model/ and data/ are created inside)")
    parser.add_argument("--model", choices=MODELS, default="ds4", help="ds4: the full tiny DS4 checkpoint (default); ds4_proxy: the attention-only proxy; tiny_dense: Llama-shaped; "
                             "ds41: the tiny DeepSeek-V4.1 (our names, seeded; Engram tables from the tokenizer)")
    parser.add_argument("--task", choices=SFT_TASKS, default="arithmetic",
                        help="arithmetic: integer Q/A chats (default); digits: demonstrations of the CPU RL task "
                             "('Repeat the digit 7.' -> '7777'), the SFT before the RL learning benchmark; long: arithmetic "
                             "turns packed into conversations of at most --seq-len tokens")
    parser.add_argument("--n-train", type=int, default=400, help="training conversations (default 400)")
    parser.add_argument("--seq-len", type=int, default=None, help="--task long: the tokens of each packed conversation, at most")
    parser.add_argument("--max-positions", type=int, default=None,
                        help="the model config's max_position_embeddings (default: the tiny model's own)")
    parser.add_argument("--n-val", type=int, default=0, help="validation conversations (default 0)")
    parser.add_argument("--seed", type=int, default=0, help="data seed (default 0)")
    args = parser.parse_args(argv)
    paths = prepare_cpu_sft_assets(args.out, model=args.model, n_train=args.n_train, n_val=args.n_val, seed=args.seed,
                                   task=args.task, seq_len=args.seq_len, max_positions=args.max_positions)
    for key, value in paths.items():
        print(f"{key}={value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
