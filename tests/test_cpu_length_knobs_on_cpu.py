"""The CPU jobs' length knobs refuse what the model or the data cannot take, before anything trains.

SFT (``scripts/run_ds4_proxy_sft_cpu.sh``): ``MAX_SEQ_LEN`` above the model folder's ``max_position_embeddings`` is
refused with the fix (``MAX_POSITIONS``), rows longer than ``MAX_SEQ_LEN`` are counted and refused by the trainer's
own dataset (``DS4ChatSFTDataset``), malformed knobs are refused by the launcher before Python starts. RL
(``scripts/run_ds4_proxy_ppo_cpu.sh``): prompt + response above the model's positions is refused. The long data
(``TASK=long``) fills every row to the length and never past it. No training runs here; each refusal has its
negative control (the same check passes the setting one step inside the limit).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_ds4.cpu import long_data
from verl_ds4.cpu.sft_data import build_char_tokenizer, tiny_llama_config, write_model_dir, write_sft_parquet

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    write_model_dir(folder, tiny_llama_config(vocab_size=128, max_position_embeddings=4096))
    return folder


def test_a_length_above_the_model_positions_is_refused_with_the_fix(model_dir):
    problems = long_data.check_max_seq_len(8192, model_dir)
    assert len(problems) == 1 and "max_position_embeddings = 4096, expected MAX_SEQ_LEN <= 4096" in problems[0]
    assert "MAX_POSITIONS=8192" in problems[0]
    assert long_data.check_max_seq_len(4096, model_dir) == []  # negative control: at the limit it passes


def test_long_rows_fill_the_length_and_longer_data_is_counted_and_refused(model_dir, tmp_path):
    tok = build_char_tokenizer()
    rows = long_data.long_conversations(3, 600, tok, seed=0)
    lengths = [long_data.token_count(tok, r) for r in rows]
    assert all(560 <= n <= 600 for n in lengths), lengths  # filled to within one Q/A turn of the length, never past
    assert rows == long_data.long_conversations(3, 600, tok, seed=0)  # deterministic
    train = write_sft_parquet(tmp_path / "train.parquet", rows)
    short = min(lengths) - 1
    problems = long_data.check_max_seq_len(short, model_dir, train)
    assert len(problems) == 1 and f"3 of 3 rows are longer than data.max_length={short}" in problems[0], problems
    assert long_data.check_max_seq_len(max(lengths), model_dir, train) == []  # negative control: the rows fit


def test_rl_prompt_plus_response_above_the_positions_is_refused(model_dir):
    from verl_ds4.rollout.demo_task import digit_prompts

    problems = long_data.check_rl_lengths(4000, 200, model_dir)
    assert len(problems) == 1 and "= 4200 tokens" in problems[0] and "MAX_POSITIONS=4200" in problems[0]
    assert long_data.check_rl_lengths(4000, 96, model_dir) == []  # negative control
    # The long prompts are as long as asked and no longer (the chat template's tokens included).
    tok = build_char_tokenizer()
    for row in digit_prompts(3, prompt_len=1000):
        n = len(tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
        assert 990 <= n <= 1000, n
        assert row["prompt"][0]["content"].endswith(f"Repeat the digit {row['reward_model']['ground_truth']}.")


def _launch(script: str, env: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    # PYTHON is a stub that fails loudly: a refusal must come from the launcher's own checks, before any Python runs.
    stub = tmp_path / "python"
    stub.write_text("#!/bin/sh\necho REACHED_PYTHON >&2\nexit 7\n")
    stub.chmod(0o755)
    full = {k: v for k, v in os.environ.items() if k not in ("MAX_SEQ_LEN", "TASK", "MAX_POSITIONS", "PROMPT_LENGTH")}
    full.update(env, PYTHON=str(stub), WORK_DIR=str(tmp_path / "run"))
    return subprocess.run(["bash", str(ROOT / "scripts" / script)], env=full, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("script", "env", "message"),
    [
        ("run_ds4_proxy_sft_cpu.sh", {"MAX_SEQ_LEN": "16k"}, "MAX_SEQ_LEN=16k: expected a positive integer (tokens)"),
        ("run_ds4_proxy_sft_cpu.sh", {"TASK": "long"}, "TASK=long: needs MAX_SEQ_LEN"),
        ("run_ds4_proxy_sft_cpu.sh", {"MAX_POSITIONS": "0"}, "MAX_POSITIONS=0: expected a positive integer"),
        ("run_ds4_proxy_ppo_cpu.sh", {"PROMPT_LENGTH": "4k"}, "PROMPT_LENGTH=4k: expected a positive integer (tokens)"),
    ],
)
def test_launcher_refuses_malformed_length_knobs_before_python(script, env, message, tmp_path):
    out = _launch(script, env, tmp_path)
    assert out.returncode == 2 and message in out.stderr and "REACHED_PYTHON" not in out.stderr, out.stderr


def test_launcher_refuses_two_lengths_and_passes_one(tmp_path):
    out = _launch("run_ds4_proxy_sft_cpu.sh", {"MAX_SEQ_LEN": "512"}, tmp_path)
    # a sketch of the real call: the launcher's own checks pass, so it reaches Python (the stub's exit)
    assert "REACHED_PYTHON" in out.stderr and "MAX_SEQ_LEN" not in out.stderr, out.stderr
    two = subprocess.run(
        ["bash", str(ROOT / "scripts" / "run_ds4_proxy_sft_cpu.sh"), "data.max_length=1024"],
        env={**os.environ, "MAX_SEQ_LEN": "512", "PYTHON": str(tmp_path / "python"), "WORK_DIR": str(tmp_path / "r")},
        capture_output=True, text=True, timeout=60,
    )
    assert two.returncode == 2 and "data.max_length=1024 with MAX_SEQ_LEN=512: two different lengths" in two.stderr, two.stderr
    assert "REACHED_PYTHON" not in two.stderr


def test_the_check_command_exits_2_with_the_message(model_dir):
    cmd = [sys.executable, "-m", "verl_ds4.cpu.long_data", "rl-check", "--prompt-len", "4090", "--response-len", "16",
           "--model-dir", str(model_dir)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2 and "expected prompt + response <= 4096" in out.stderr, out.stderr
    cmd[5] = "6"
    assert subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}).returncode == 0  # negative control


def test_the_knobs_reach_verl_and_the_assets(tmp_path):
    """The command lines the launchers build, read through a stand-in interpreter that prints its arguments (nothing
    runs): MAX_SEQ_LEN is data.max_length, TASK=long asks the assets for rows of that length, PROMPT_LENGTH is
    data.max_prompt_length and the prompts' length; without them the defaults stand (the control)."""
    stub, log = tmp_path / "python", tmp_path / "calls.txt"
    stub.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" | tee -a {log}\n')  # every call's arguments, captured or not
    stub.chmod(0o755)

    def args(script, **knobs):
        log.write_text("")
        env = {"PATH": "/usr/bin:/bin", "PYTHON": str(stub), "WORK_DIR": str(tmp_path / "w"), **knobs}
        out = subprocess.run(["bash", str(ROOT / "scripts" / script)], env=env, cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        return log.read_text().splitlines()

    sft = args("run_ds4_proxy_sft_cpu.sh", MAX_SEQ_LEN="16384", MAX_POSITIONS="16384", TASK="long")
    assert "data.max_length=16384" in sft and "data.max_length=256" not in sft
    assert any(a == "--seq-len" for a in sft) and "--max-positions" in sft and "--max-seq-len" in sft
    assert "data.max_length=256" in args("run_ds4_proxy_sft_cpu.sh") and "--max-seq-len" not in args("run_ds4_proxy_sft_cpu.sh")
    rl = args("run_ds4_proxy_ppo_cpu.sh", PROMPT_LENGTH="4000", RESPONSE_LENGTH="8")
    assert "data.max_prompt_length=4000" in rl and "--prompt-len" in rl and "rl-check" in rl
    assert not any(a.startswith("data.max_prompt_length=") for a in args("run_ds4_proxy_ppo_cpu.sh"))
