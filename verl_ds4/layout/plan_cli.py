"""Show how one micro-batch is laid out over context-parallel ranks.

Given sequence lengths (a list, or a parquet file and a column), the CP size and the layout,
print for every CP rank its rows, real tokens, padding, compute cost under a per-token cost
model, and the straggler ratio (largest per-rank cost / mean). With --balance the contiguous
buffer is reordered to minimise the largest per-rank cost, and the plain and balanced layouts are
both shown. --plot out.png draws the packed buffer (one colour per sequence, hatched padding,
rank boundaries) and the per-rank costs; it needs matplotlib (pip install 'verl-ds4[plot]').
Examples: verl-ds4 plan --lengths 5,127,1000,23 --cp 2 --min-local-rows 128;
verl-ds4 plan --parquet train.parquet --column input_ids --limit 256 --cp 8 --balance ds4 --plot layout.png
"""

from __future__ import annotations

import argparse
import sys

import torch

from .cost import COST_MODELS, TokenCostModel, get_cost_model
from .plan import PlanOptions, THDPlan, build_plan
from .types import CPLayout


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_argument_group("lengths (one of)")
    src.add_argument("--lengths", help="comma- or space-separated sequence lengths, e.g. 5,127,1000")
    src.add_argument("--parquet", help="parquet file with one row per sequence")
    src.add_argument(
        "--column",
        help="parquet column: integer lengths, or tokenised sequences (lists of ids) whose lengths are used",
    )
    src.add_argument("--limit", type=int, help="use only the first N rows of the parquet file (one micro-batch)")
    parser.add_argument("--cp", type=int, required=True, help="context-parallel size")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1; DS4 needs 1)")
    parser.add_argument(
        "--layout",
        choices=[m.value for m in CPLayout],
        default="contiguous",
        help="CP layout (default contiguous, what DS4 needs)",
    )
    parser.add_argument(
        "--balance",
        choices=sorted(COST_MODELS),
        help="contiguous only: reorder sequences to balance this cost model; prints plain and balanced",
    )
    parser.add_argument(
        "--cost-model",
        choices=sorted(COST_MODELS),
        help="per-token cost model used for the cost columns (default: --balance, else ds4)",
    )
    parser.add_argument("--min-local-rows", type=int, help="pad so every rank owns at least this many rows (DS4: 128)")
    parser.add_argument("--bucket", type=int, help="pad the buffer to a multiple of this many rows")
    parser.add_argument("--fp8-padding", action="store_true", help="apply FP8 block-quantisation padding")
    parser.add_argument("--plot", metavar="PNG", help="draw the packed buffer and per-rank costs to this PNG file")


def read_lengths(args: argparse.Namespace) -> torch.Tensor:
    """Sequence lengths from ``--lengths`` or ``--parquet``/``--column``; clear errors otherwise."""
    if bool(args.lengths) == bool(args.parquet):
        raise ValueError("give exactly one of --lengths or --parquet (with --column)")
    if args.lengths:
        parts = [p for p in args.lengths.replace(",", " ").split() if p]
        try:
            values = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"--lengths must be integers separated by commas or spaces, got {args.lengths!r}") from None
    else:
        if not args.column:
            raise ValueError("--parquet needs --column: the column holding lengths or tokenised sequences")
        values = _parquet_lengths(args.parquet, args.column)
    if args.limit is not None:
        if args.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {args.limit}")
        values = values[: args.limit]
    if not values:
        raise ValueError("no sequences: the length list is empty")
    if min(values) < 0:
        raise ValueError(f"sequence lengths must be non-negative, got {min(values)}")
    return torch.tensor(values, dtype=torch.int64)


def _parquet_lengths(path: str, column: str) -> list[int]:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    if column not in schema.names:
        raise ValueError(f"column {column!r} not in {path}; columns are {schema.names}")
    col = pq.read_table(path, columns=[column]).column(column)
    typ = col.type
    import pyarrow as pa

    if pa.types.is_integer(typ):
        return [int(v) for v in col.to_pylist()]
    if pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ):
        return [int(v) for v in pc.list_value_length(col).to_pylist()]
    if pa.types.is_string(typ) or pa.types.is_large_string(typ):
        raise ValueError(
            f"column {column!r} holds text, not tokens: tokenise it first and pass the token-id column "
            "(or a column of integer lengths)"
        )
    raise ValueError(f"column {column!r} has type {typ}; expected integer lengths or lists of token ids")


def rank_summary(plan: THDPlan, cost_model: TokenCostModel) -> list[dict]:
    """Per-rank rows, real tokens, padding, sequences touched and cost, from the plan's own row maps."""
    rows = []
    for r in range(plan.cp_size):
        info = plan.rank_rows(r)
        slot, position, valid = info.slot, info.position, info.valid
        real = int(valid.sum())
        cost = float(cost_model.token_cost(position[valid]).sum()) + cost_model.pad_row_cost * (plan.local_rows - real)
        seqs = slot.unique()
        rows.append(dict(rank=r, rows=plan.local_rows, real=real, pad=plan.local_rows - real, seqs=seqs.numel(), cost=cost))
    return rows


def _format(plan: THDPlan, summary: list[dict], title: str, unit: str) -> str:
    mean = sum(s["cost"] for s in summary) / len(summary)
    ratio = max(s["cost"] for s in summary) / mean if mean > 0 else 1.0
    lines = [f"{title}: {plan.batch_size} sequences, {plan.num_tokens} tokens, {plan.total_rows} rows "
             f"({plan.total_rows - plan.num_tokens} padding), {plan.local_rows} rows per rank"]
    contiguous = plan.layout is CPLayout.CONTIGUOUS or plan.cp_size == 1
    lines.append(f"  {'rank':>4} {'global rows':>21} {'real':>9} {'pad':>7} {'seqs':>5} {'cost':>14} {'/mean':>6}")
    for s in summary:
        r = s["rank"]
        span = f"[{r * plan.local_rows}, {(r + 1) * plan.local_rows})" if contiguous else "(2 chunks/seq)"
        lines.append(
            f"  {r:>4} {span:>21} {s['real']:>9} {s['pad']:>7} {s['seqs']:>5} {s['cost']:>14.4g} {s['cost'] / mean:>6.3f}"
        )
    lines.append(f"  straggler ratio (max/mean cost, {unit}): {ratio:.4f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        lengths = read_lengths(args)
        if args.cp < 1 or args.tp < 1:
            raise ValueError(f"--cp and --tp must be >= 1, got cp={args.cp} tp={args.tp}")
        if args.balance and args.layout != "contiguous":
            raise ValueError(f"--balance reorders the contiguous layout only; got --layout {args.layout}")
        cost_model = get_cost_model(args.cost_model or args.balance or "ds4")
        base = dict(
            layout=args.layout,
            tp_size=args.tp,
            cp_size=args.cp,
            min_local_rows=args.min_local_rows,
            pad_to_length_bucket=args.bucket,
            fp8_padding=args.fp8_padding,
        )
        plans = [("plain" if args.balance else args.layout, build_plan(lengths, PlanOptions(**base)))]
        if args.balance:
            plans.append((f"balanced ({args.balance} cost)", build_plan(lengths, PlanOptions(**base, balance=args.balance))))
    except ValueError as exc:
        print(f"verl-ds4 plan: error: {exc}", file=sys.stderr)  # error-catalogue: prefixes the message of the error it caught, catalogued where raised
        return 2
    summaries = []
    for title, plan in plans:
        summary = rank_summary(plan, cost_model)
        summaries.append(summary)
        print(_format(plan, summary, f"{title} {plan.layout} layout, cp={plan.cp_size}", f"{cost_model.name} model, {cost_model.unit}"))
        if plan.order is not None:
            shown = plan.order[:32].tolist()
            print(f"  buffer order: {shown}{' ...' if plan.batch_size > 32 else ''}")
        print()
    if args.plot:
        try:
            plot_plans(plans, summaries, args.plot, cost_model)
        except ImportError as exc:
            print(f"verl-ds4 plan: error: {exc}", file=sys.stderr)  # error-catalogue: prefixes the message of the error it caught, catalogued where raised
            return 2
        print(f"wrote {args.plot}")
    return 0


def _segments(plan: THDPlan):
    """(rank, local start, length, sequence id, is padding) runs of every rank's rows."""
    out = []
    for r in range(plan.cp_size):
        info = plan.rank_rows(r)
        slot, valid = info.slot, info.valid
        seq = slot if plan.order is None else plan.order[slot]
        key = seq * 2 + (~valid).long()
        change = torch.ones_like(key, dtype=torch.bool)
        change[1:] = key[1:] != key[:-1]
        starts = change.nonzero().flatten()
        ends = torch.cat([starts[1:], torch.tensor([key.numel()])])
        for s, e in zip(starts.tolist(), ends.tolist()):
            out.append((r, s, e - s, int(seq[s]), not bool(valid[s])))
    return out


def plot_plans(plans, summaries, path: str, cost_model: TokenCostModel) -> None:
    """Draw each plan's packed buffer (one colour per sequence, hatched padding) and per-rank costs."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(
            "--plot needs matplotlib, which is not installed: pip install 'verl-ds4[plot]' (or pip install matplotlib)"
        ) from None

    n = len(plans)
    fig, axes = plt.subplots(n, 2, figsize=(14, 1.6 + 1.4 * n * max(1, plans[0][1].cp_size / 8)),
                             gridspec_kw={"width_ratios": [4, 1]}, squeeze=False)
    cmap = plt.get_cmap("tab20")
    for (title, plan), summary, (ax, axc) in zip(plans, summaries, axes):
        contiguous = plan.layout is CPLayout.CONTIGUOUS or plan.cp_size == 1
        for r, start, length, seq, pad in _segments(plan):
            x = r * plan.local_rows + start if contiguous else start
            y = 0 if contiguous else plan.cp_size - 1 - r
            ax.broken_barh(
                [(x, length)], (y, 0.9), facecolors=cmap(seq % 20), alpha=0.35 if pad else 1.0,
                hatch="//" if pad else None, edgecolor="none",
            )
        if contiguous:
            for r in range(1, plan.cp_size):
                ax.axvline(r * plan.local_rows, color="black", lw=1.5)
            ax.set_xlim(0, plan.total_rows)
            ax.set_ylim(-0.1, 1.0)
            ax.set_yticks([])
            ax.set_xlabel("global buffer row (black lines: CP rank boundaries)")
        else:
            ax.set_xlim(0, plan.local_rows)
            ax.set_yticks([plan.cp_size - 1 - r + 0.45 for r in range(plan.cp_size)])
            ax.set_yticklabels([f"rank {r}" for r in range(plan.cp_size)])
            ax.set_xlabel("local row")
        costs = [s["cost"] for s in summary]
        mean = sum(costs) / len(costs)
        ratio = max(costs) / mean if mean > 0 else 1.0
        ax.set_title(f"{title}: {plan.layout} cp={plan.cp_size}, {plan.batch_size} sequences, "
                     f"straggler {ratio:.3f} ({cost_model.name} cost)", fontsize=9)
        axc.bar(range(plan.cp_size), [c / mean for c in costs], color="tab:gray")
        axc.axhline(1.0, color="black", lw=1)
        axc.set_ylim(0, max(1.1, max(costs) / mean * 1.05))
        axc.set_xlabel("CP rank")
        axc.set_ylabel("cost / mean")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
