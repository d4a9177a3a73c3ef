"""`verl-ds4 plan`: lengths from a list or a parquet column, per-rank table, plot."""

from __future__ import annotations

import re

import pytest
import torch

from verl_ds4.cli import main
from verl_ds4.layout import PlanOptions, build_plan
from verl_ds4.layout.balance import rank_costs, straggler_ratio

LENGTHS = "5,127,1000,23,129,900,55,257,800,95,509,148"


def _ratios(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"straggler ratio \(max/mean cost[^)]*\): ([0-9.]+)", out)]


def _rank_rows(out: str) -> list[tuple[int, int, int]]:
    """(rank, real, pad) of every per-rank table line."""
    rows = re.findall(r"^\s+(\d+)\s+\[\d+, \d+\)\s+(\d+)\s+(\d+)\s", out, flags=re.M)
    return [tuple(int(v) for v in r) for r in rows]


def test_plan_prints_per_rank_rows_padding_and_straggler_ratio(capsys):
    assert main(["plan", "--lengths", LENGTHS, "--cp", "4", "--layout", "contiguous", "--min-local-rows", "128"]) == 0
    out = capsys.readouterr().out
    lens = torch.tensor([int(v) for v in LENGTHS.split(",")])
    plan = build_plan(lens, PlanOptions(layout="contiguous", cp_size=4, min_local_rows=128))
    rows = _rank_rows(out)
    assert [r[0] for r in rows] == [0, 1, 2, 3]
    assert sum(r[1] for r in rows) == int(lens.sum())
    assert all(r[1] + r[2] == plan.local_rows for r in rows)
    expected = straggler_ratio(rank_costs(lens, cp_size=4, cost_model="ds4", min_local_rows=128))
    assert _ratios(out) == [pytest.approx(expected, abs=1e-4)]


def test_plan_balance_shows_plain_and_balanced(capsys):
    assert main(["plan", "--lengths", LENGTHS, "--cp", "4", "--balance", "dense"]) == 0
    out = capsys.readouterr().out
    plain, balanced = _ratios(out)
    assert balanced < plain
    assert "buffer order:" in out


def test_plan_zigzag_layout(capsys):
    assert main(["plan", "--lengths", "300 500 64", "--cp", "2", "--layout", "zigzag", "--cost-model", "dense"]) == 0
    out = capsys.readouterr().out
    assert "zigzag layout, cp=2" in out and len(_ratios(out)) == 1
    # zigzag balances dense causal attention of every sequence
    assert _ratios(out)[0] < 1.01


def test_plan_reads_parquet_lengths_and_token_lists(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "batch.parquet"
    pq.write_table(
        pa.table({"n": [300, 20, 700], "input_ids": [list(range(300)), list(range(20)), list(range(700))], "text": ["a", "b", "c"]}),
        path,
    )
    for column in ("n", "input_ids"):
        assert main(["plan", "--parquet", str(path), "--column", column, "--cp", "2"]) == 0
        out = capsys.readouterr().out
        assert "3 sequences, 1020 tokens" in out
    assert main(["plan", "--parquet", str(path), "--column", "input_ids", "--limit", "2", "--cp", "2"]) == 0
    assert "2 sequences, 320 tokens" in capsys.readouterr().out
    assert main(["plan", "--parquet", str(path), "--column", "text", "--cp", "2"]) == 2
    assert "tokenise it first" in capsys.readouterr().err
    assert main(["plan", "--parquet", str(path), "--column", "missing", "--cp", "2"]) == 2
    assert "columns are" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--cp", "2"], "exactly one of --lengths or --parquet"),
        (["--lengths", "3,x", "--cp", "2"], "must be integers"),
        (["--lengths", "3,-1", "--cp", "2"], "non-negative"),
        (["--lengths", "3,4", "--cp", "2", "--layout", "zigzag", "--balance", "ds4"], "contiguous layout only"),
        (["--lengths", "3,4", "--cp", "0"], "--cp and --tp must be >= 1"),
    ],
)
def test_plan_rejects_bad_input_with_a_clear_message(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err


def test_plan_plot_writes_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "layout.png"
    assert main(["plan", "--lengths", LENGTHS, "--cp", "4", "--balance", "ds4", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    zz = tmp_path / "zigzag.png"
    assert main(["plan", "--lengths", LENGTHS, "--cp", "2", "--layout", "zigzag", "--plot", str(zz)]) == 0
    assert zz.exists()


def test_plan_plot_without_matplotlib_says_how_to_install(tmp_path, capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert main(["plan", "--lengths", "10,20", "--cp", "2", "--plot", str(tmp_path / "x.png")]) == 2
    assert "pip install 'verl-ds4[plot]'" in capsys.readouterr().err
