"""The CPU PPO/GRPO launcher's console view: one line per RL step from verl's console metrics, a summary table,
the reward trend line and a PNG of reward, value loss, KL and the rollout/trainer mismatch per step."""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

from verl_ds4.cpu.console_run import ConsoleView, ANSI_ESCAPE, LAYOUT_LINE, format_duration, layout_fact, say

_STEP_LINE = re.compile(r"(?:^|\s)step:(\d+) - (.*)$")
_ROLLOUT_READY = re.compile(r"(cpu_demo rollout server \d+ ready)")
# verl_ds4.rollout.mismatch_gate's error (its GATE_MARK; this floor may not import the rollout package)
_GATE_STOP = re.compile(r"(verl-ds4 mismatch gate: step \d+: .*?above the threshold \S+ \([^)]*\))")


# ------------------------------------------------------------------------------- the PPO/GRPO job

# (metric key in verl's console line, column title)
SUMMARY_COLUMNS = (
    ("critic/score/mean", "reward"),
    ("critic/vf_loss", "value_loss"),
    ("actor/kl_loss", "kl(actor|ref)"),
    ("actor/pg_loss", "pg_loss"),
    ("critic/values/mean", "value_mean"),
    ("response_length/mean", "resp_len"),
    # rollout vs actor log-probs on the sampled tokens (verl_ds4.rollout.mismatch_gate)
    ("training/rollout_log_probs_diff_max", "lp_diff_max"),
    ("rollout_corr/k3_kl", "k3_kl"),
    ("timing_s/gen", "gen_s"),
    ("timing_s/step", "step_s"),
)

REWARD_KEY = "critic/score/mean"
#: Rollout-vs-trainer mismatch metrics, the first one found is plotted: the mismatch gate's max abs log-prob
#: difference (verl_ds4.rollout.mismatch_gate), else verl's own probability differences.
MISMATCH_KEYS = ("training/rollout_log_probs_diff_max", "training/rollout_probs_diff_max",
                 "training/rollout_probs_diff_mean")
#: Steps averaged at each end of the run for the reward trend line.
TREND_STEPS = 5
ALGOS = ("ppo", "grpo")


def reward_trend(metrics: dict[int, dict[str, float]], k: int = TREND_STEPS) -> tuple[int, float, float] | None:
    """``(k, first-k mean, last-k mean)`` of the mean reward; ``k`` shrinks to half the steps of a short
    run (``None`` with fewer than 2 steps that report a reward)."""
    rewards = [metrics[s][REWARD_KEY] for s in sorted(metrics) if REWARD_KEY in metrics[s]]
    k = min(k, len(rewards) // 2)
    if k < 1:
        return None
    return k, sum(rewards[:k]) / k, sum(rewards[-k:]) / k


def reward_trend_line(metrics: dict[int, dict[str, float]]) -> str:
    """``reward: first 5 steps mean A, last 5 steps mean B`` (see :func:`reward_trend`)."""
    trend = reward_trend(metrics)
    if trend is None:
        return "reward: fewer than 2 steps with a reward, no trend"
    k, first, last = trend
    return f"reward: first {k} steps mean {first:.3f}, last {k} steps mean {last:.3f}"


def plot_rl_metrics(metrics: dict[int, dict[str, float]], path: str | Path, *, title: str = "") -> str:
    """Write a PNG with reward, value loss, KL and the mismatch per step; returns a one-line note (the
    path, or why there is no plot). A metric the run did not report is drawn as "not reported"."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install 'verl-ds4[plot]')"
    if not metrics:
        return "no plot: no steps"
    mismatch = next((k for k in MISMATCH_KEYS if any(k in m for m in metrics.values())), MISMATCH_KEYS[0])
    panels = [
        (REWARD_KEY, "mean reward"),
        ("critic/vf_loss", "value loss"),
        ("actor/kl_loss", "KL(actor | ref)"),
        (mismatch, "rollout vs trainer\n" + mismatch.rpartition("/")[2]),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.2), dpi=100)
    for ax, (key, label) in zip(axes, panels):
        points = [(s, metrics[s][key]) for s in sorted(metrics) if key in metrics[s]]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="." if len(xs) < 40 else None, lw=1.2)
        else:
            ax.text(0.5, 0.5, "not reported", ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def parse_step_metrics(text: str) -> dict[int, dict[str, float]]:
    """``{step: {metric: value}}`` from verl's console logger lines (``step:N - a:1.0 - b:2 ...``)."""
    steps: dict[int, dict[str, float]] = {}
    for line in ANSI_ESCAPE.sub("", text).splitlines():
        match = _STEP_LINE.search(line)
        if not match:
            continue
        values: dict[str, float] = {}
        for item in match.group(2).split(" - "):
            key, sep, value = item.strip().rpartition(":")
            if not sep:
                continue
            try:
                values[key] = float(value)
            except ValueError:
                continue
        steps[int(match.group(1))] = values
    return steps


def summary_table(metrics: dict[int, dict[str, float]]) -> str:
    """A small fixed-width table of :data:`SUMMARY_COLUMNS` per step."""
    header = ["step"] + [title for _, title in SUMMARY_COLUMNS]
    rows = [header]
    for step in sorted(metrics):
        row = [str(step)]
        for key, _ in SUMMARY_COLUMNS:
            value = metrics[step].get(key)
            row.append("-" if value is None else f"{value:.4g}")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)


def _line_metrics(line: str) -> tuple[int, dict[str, float]] | None:
    metrics = parse_step_metrics(line)
    return next(iter(metrics.items())) if metrics else None


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


class PPOConsole(ConsoleView):
    """The CPU PPO/GRPO launcher's console: facts, one line per PPO step with an ETA, the summary table."""

    name = "ppo"

    def __init__(self, work_dir: str | Path, total_steps: int, *, facts=(), algo: str = "ppo",
                 from_checkpoint: bool = False, reward_rise: float | None = None, plot: bool = True):
        if algo not in ALGOS:
            raise ValueError(f"algo={algo!r}; expected one of {ALGOS}.")
        self.work_dir = Path(work_dir)
        self.total_steps = total_steps
        self.facts = list(facts)
        self.algo = algo
        self.from_checkpoint = from_checkpoint
        self.reward_rise = reward_rise
        self.plot = plot
        self._layouts: set[str] = set()
        self._ready = False
        self._start = time.monotonic()
        self._step_times: list[float] = []
        self._printed: set[int] = set()
        self._gate_stopped = False

    def header(self, log_path: Path) -> list[str]:
        lines = [say(f"{key:<11} {value}") for key, value in self.facts]
        lines.append(say(f"{'log':<11} {log_path} (verl, Ray and worker output; VERBOSE=1 shows it here)"))
        return lines

    def on_line(self, line: str) -> list[str]:
        if "step:" in line and (found := _line_metrics(line)):
            step, m = found
            if step in self._printed:
                return []
            self._printed.add(step)
            if "timing_s/step" in m:
                self._step_times.append(m["timing_s/step"])
            mean = sum(self._step_times) / len(self._step_times) if self._step_times else float("nan")
            eta = mean * max(0, self.total_steps - step)
            return [say(
                f"step {step}/{self.total_steps} | reward {_fmt(m.get('critic/score/mean'))} | value_loss "
                f"{_fmt(m.get('critic/vf_loss'))} | kl {_fmt(m.get('actor/kl_loss'))} | step "
                f"{format_duration(m.get('timing_s/step', float('nan')))} | rollout/actor lp_diff_max "
                f"{_fmt(m.get('training/rollout_log_probs_diff_max'))} k3 {_fmt(m.get('rollout_corr/k3_kl'))} | elapsed "
                f"{format_duration(time.monotonic() - self._start)} | ETA {format_duration(eta)}"
            )]
        if (m := LAYOUT_LINE.search(line)) and m.group(1) not in self._layouts:
            self._layouts.add(m.group(1))
            return [layout_fact(m)]
        if not self._gate_stopped and (m := _GATE_STOP.search(line)):
            self._gate_stopped = True
            return [say(f"{'GATE STOP':<11} {m.group(1)}")]
        if not self._ready and (m := _ROLLOUT_READY.search(line)):
            self._ready = True
            return [say(f"{'rollout':<11} {m.group(1)}")]
        return []

    def summary(self, log_path: Path, returncode: int, wall_s: float) -> list[str]:
        metrics = parse_step_metrics(log_path.read_text(errors="replace"))
        plot_note = None
        if self.plot and metrics:
            plot_note = plot_rl_metrics(metrics, self.work_dir / "rl_metrics.png",
                                        title=f"{self.algo.upper()} on CPU, {self.work_dir.name}")
        return ppo_summary_lines(metrics, self.total_steps, self.work_dir / "checkpoints", wall_s=wall_s,
                                 log_path=log_path, algo=self.algo, from_checkpoint=self.from_checkpoint,
                                 reward_rise=self.reward_rise, plot_note=plot_note)


_PATH = {
    "ppo": "rollout, reward, values, GAE, updates, weight sync",
    "grpo": "rollout, reward, group-relative advantages, actor update, weight sync",
}


def ppo_summary_lines(metrics: dict[int, dict[str, float]], total_steps: int | None, ckpt_dir: Path | None = None,
                      *, wall_s: float | None = None, log_path: str | Path | None = None, algo: str = "ppo",
                      from_checkpoint: bool = False, reward_rise: float | None = None,
                      plot_note: str | None = None) -> list[str]:
    """The summary: a verdict on the RL path (and, with ``reward_rise``, on learning: did the last-5 mean
    reward beat the first-5 mean by that much), the table, the reward trend line, paths."""
    name = algo.upper()
    lines = [say("-" * 26 + " summary " + "-" * 26)]
    if not metrics:
        lines.append(say("result      NO PPO STEPS: no 'step:N - ...' metric line in the log"))
    else:
        last = max(metrics)
        bad = sorted({k for m in metrics.values() for k, v in m.items() if not math.isfinite(v)} & {
            k for k, _ in SUMMARY_COLUMNS})
        trend = reward_trend(metrics)
        if total_steps and last < total_steps:
            verdict = f"INCOMPLETE: the run stopped at {name} step {last} of {total_steps}"
        elif bad:
            verdict = f"NOT FINITE: {', '.join(bad)}"
        elif reward_rise is not None:
            rise = float("nan") if trend is None else trend[2] - trend[1]
            if trend is not None and rise >= reward_rise:
                verdict = f"LEARNED: the mean reward rose by {rise:.3f} (>= {reward_rise:g}) in {len(metrics)} {name} steps"
            else:
                verdict = (f"DID NOT LEARN ENOUGH: the mean reward rose by {rise:.3f} in {len(metrics)} {name} steps, "
                           f"expected >= {reward_rise:g}")
        else:
            start = ("started from the given checkpoint" if from_checkpoint
                     else "the model is random, so this is not a test of learning")
            verdict = (f"the RL path ran: {len(metrics)} {name} step{'s' * (len(metrics) != 1)} ({_PATH[algo]}), "
                       f"all metrics finite; {start}")
        lines.append(say(f"result      {verdict}"))
        lines += [say("  " + row) for row in summary_table(metrics).splitlines()]
        lines.append(say(reward_trend_line(metrics)))
    if plot_note is not None:
        lines.append(say(f"{'plot':<11} {plot_note}"))
    if wall_s is not None:
        lines.append(say(f"wall time   {format_duration(wall_s)}"))
    if ckpt_dir is not None:
        tracker = Path(ckpt_dir) / "latest_checkpointed_iteration.txt"
        step = tracker.read_text().strip() if tracker.exists() else ""
        lines.append(say(f"checkpoint  {Path(ckpt_dir) / f'global_step_{step}' if step else 'none'}"))
    if log_path is not None:
        lines.append(say(f"full log    {log_path}"))
    return lines
