"""The SFT main job's console view, its summary (did training work?) and the loss curve.

:class:`SFTConsole` reads the CPU engine's progress lines (:func:`verl_ds4.cpu.progress.progress_line`)
and verl's checkpoint prints; :func:`summarize_sft` turns a log into the summary (loss trend, tokens/s,
checkpoint, resume step); :func:`plot_losses` writes the loss curve PNG (matplotlib, the ``plot`` extra).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from verl_ds4.cpu.console_run import ConsoleView, PREFIX, ANSI_ESCAPE, LAYOUT_LINE, format_duration, layout_fact, say

WINDOW = 20  # steps in the first/last loss means of the summary
FELL_BELOW = -0.05  # relative change of the mean loss (last window vs first) below which "the loss fell"

_PROGRESS = re.compile(
    r"\[verl-ds4\] step (\d+) \| loss (\S+) \| (\S+) tok/s \| elapsed ([0-9.]+)s"
)
_FOUND_CKPT = re.compile(r"Found latest checkpoint: (\S+) \(step (\d+)\)")
_SAVING = re.compile(r"Saving checkpoint to: (\S+)")
_PARAMS = re.compile(r"DistributedDataParallel contains (\S+) parameters")
_VERL_TOKENS = re.compile(r"step:(\d+) - .*?train/global_tokens:([0-9.]+)")




# ------------------------------------------------------------------------------------ the SFT job


@dataclass
class Progress:
    step: int
    loss: float
    tok_s: float
    elapsed: float


def parse_progress(text: str) -> list[Progress]:
    """The CPU engine's progress lines of a log, in order (a repeated step: the last one wins)."""
    by_step: dict[int, Progress] = {}
    for step, loss, rate, elapsed in _PROGRESS.findall(ANSI_ESCAPE.sub("", text)):
        by_step[int(step)] = Progress(int(step), float(loss), float(rate), float(elapsed))
    return [by_step[s] for s in sorted(by_step)]


@dataclass
class SFTSummary:
    steps: list[int] = field(default_factory=list)  # this run's steps
    losses: list[float] = field(default_factory=list)
    #: The loss curve the trend is judged on: earlier runs' steps up to the resume step, then this run's.
    curve_steps: list[int] = field(default_factory=list)
    curve_losses: list[float] = field(default_factory=list)
    total_steps: int | None = None
    resumed_from: int | None = None
    resumed_path: str | None = None
    checkpoint: str | None = None
    tokens_per_s: float | None = None
    train_s: float | None = None
    first_mean: float | None = None
    last_mean: float | None = None
    window: int = 0
    verdict: str = ""
    worked: bool = False

    @property
    def rel_change(self) -> float | None:
        if self.first_mean is None or self.last_mean is None or self.first_mean == 0:
            return None
        return (self.last_mean - self.first_mean) / abs(self.first_mean)


def summarize_sft(text: str, total_steps: int | None = None, window: int = WINDOW,
                  earlier: Sequence[tuple[int, float]] = ()) -> SFTSummary:
    """The summary of an SFT log: steps, loss trend (first vs last ``window``-step mean), speed, checkpoint.

    ``earlier``: ``(step, loss)`` of the runs before a resume; those up to the resume step come
    before this run's steps in the curve the trend is judged on.
    ``worked`` is True only if every loss is finite, the run reached ``total_steps`` (when given),
    and the mean loss fell by more than ``-FELL_BELOW`` (5 %); ``verdict`` says why in words.
    """
    text = ANSI_ESCAPE.sub("", text)
    progress = parse_progress(text)
    summary = SFTSummary(total_steps=total_steps)
    found = _FOUND_CKPT.findall(text)
    if found:
        summary.resumed_path, step = found[-1]
        summary.resumed_from = int(step)
    elif progress and progress[0].step > 1:
        summary.resumed_from = progress[0].step - 1
    saved = _SAVING.findall(text)
    summary.checkpoint = saved[-1] if saved else None
    summary.steps = [p.step for p in progress]
    summary.losses = [p.loss for p in progress]
    if progress:
        summary.train_s = progress[-1].elapsed
        # Speed of the training steps themselves (checkpoint saves between steps not counted):
        # each step's time is its tokens (verl's train/global_tokens) over its tokens/s.
        tokens = {int(s): float(t) for s, t in _VERL_TOKENS.findall(text)}
        timed = [(tokens[p.step], tokens[p.step] / p.tok_s) for p in progress
                 if p.step in tokens and math.isfinite(p.tok_s) and p.tok_s > 0]
        if timed and sum(t for _, t in timed) > 0:
            summary.tokens_per_s = sum(n for n, _ in timed) / sum(t for _, t in timed)
        else:
            rates = [p.tok_s for p in progress if math.isfinite(p.tok_s) and p.tok_s > 0]
            summary.tokens_per_s = len(rates) / sum(1 / r for r in rates) if rates else None

    upto = summary.resumed_from or 0
    before = sorted((st, lo) for st, lo in dict(earlier).items() if st <= upto)
    summary.curve_steps = [st for st, _ in before] + summary.steps
    summary.curve_losses = [lo for _, lo in before] + summary.losses
    n = len(summary.curve_steps)
    if not progress:
        summary.verdict = "NO TRAINING STEPS: no '[verl-ds4] step N | loss ...' line in the log"
        return summary
    bad = [st for st, lo in zip(summary.curve_steps, summary.curve_losses) if not math.isfinite(lo)]
    if bad:
        summary.verdict = f"TRAINING FAILED: the loss is not finite at step {bad[0]}"
        return summary
    summary.window = min(window, n // 2)
    if summary.window < 1:
        summary.verdict = f"too few steps to judge the loss trend ({n} step{'s' * (n != 1)})"
    else:
        summary.first_mean = sum(summary.curve_losses[: summary.window]) / summary.window
        summary.last_mean = sum(summary.curve_losses[-summary.window :]) / summary.window
        change = summary.rel_change
        if change is not None and change < FELL_BELOW:
            summary.worked = True
            summary.verdict = f"training worked: the loss fell by {-change:.0%}"
        else:
            summary.verdict = (
                f"NOT LEARNING: the loss did not fall ({change:+.1%} from the first to the last "
                f"{summary.window}-step mean); check the learning rate and the data"
            )
    if total_steps is not None and summary.steps[-1] < total_steps:
        summary.worked = False
        summary.verdict = f"INCOMPLETE: the run stopped at step {summary.steps[-1]} of {total_steps}; " + summary.verdict
    return summary


def plot_losses(steps: Sequence[int], losses: Sequence[float], path: str | Path, *, title: str = "",
                resumed_from: int | None = None) -> str:
    """Write the loss curve PNG; returns a one-line note (the path, or why there is no plot)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no loss plot: matplotlib is not installed (pip install 'verl-ds4[plot]')"
    if not steps:
        return "no loss plot: no steps"
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(list(steps), list(losses), marker="." if len(steps) < 40 else None, lw=1.2)
    if resumed_from:
        ax.axvline(resumed_from + 0.5, color="grey", ls="--", lw=0.8, label=f"resumed after step {resumed_from}")
        ax.legend(loc="upper right", fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title or "training loss", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def _history(log_dir: Path, current: Path) -> list[tuple[int, float]]:
    """``(step, loss)`` from the other logs in ``log_dir``, oldest first (a later log's step wins)."""
    by_step: dict[int, float] = {}
    for old in sorted(p for p in log_dir.glob("*.log") if not p.is_symlink() and p.resolve() != current.resolve()):
        for p in parse_progress(old.read_text(errors="replace")):
            by_step[p.step] = p.loss
    return sorted(by_step.items())


def sft_summary_lines(summary: SFTSummary, *, wall_s: float | None = None, log_path: str | Path | None = None,
                      plot_note: str | None = None) -> list[str]:
    """The console lines of :class:`SFTSummary` (every one well under 300 characters)."""
    s = summary
    lines = [say("-" * 26 + " summary " + "-" * 26), say(f"result      {s.verdict}")]
    if s.steps:
        done = f"{len(s.steps)} in this run (steps {s.steps[0]}-{s.steps[-1]}"
        done += f" of {s.total_steps})" if s.total_steps else ")"
        if s.resumed_from is not None:
            done += f"; resumed from step {s.resumed_from}"
        lines.append(say(f"steps       {done}"))
        if s.total_steps and s.resumed_from is not None and s.resumed_from >= s.total_steps:
            lines.append(say(f"            (the checkpoint was already at step {s.resumed_from} of {s.total_steps}: "
                             "verl's sft_trainer still trains one more step; raise STEPS to train on)"))
    if s.window:
        lines.append(say(
            f"loss        first {s.window}-step mean {s.first_mean:.4f} -> last {s.window}-step mean "
            f"{s.last_mean:.4f} ({s.rel_change:+.1%}); last step {s.losses[-1]:.4f}"
        ))
        if len(s.curve_steps) > len(s.steps):
            lines.append(say(f"            (steps {s.curve_steps[0]}-{s.curve_steps[-1]}: the earlier runs' logs up "
                             f"to step {s.resumed_from}, then this run)"))
    elif s.losses:
        lines.append(say(f"loss        {', '.join(f'{x:.4f}' for x in s.losses[:8])}"))
    if s.tokens_per_s is not None:
        lines.append(say(f"speed       {s.tokens_per_s:.0f} tokens/s in the training steps; "
                          f"{format_duration(s.train_s or 0)} from the first step to the last"))
    if wall_s is not None:
        lines.append(say(f"wall time   {format_duration(wall_s)} (start-up and checkpoints included)"))
    lines.append(say(f"checkpoint  {s.checkpoint or 'none written by this run'}"))
    if plot_note:
        lines.append(say(f"loss plot   {plot_note}"))
    if log_path is not None:
        lines.append(say(f"full log    {log_path}"))
    return lines


class SFTConsole(ConsoleView):
    """The SFT main job's console: facts, progress every ``every`` steps with an ETA, the summary."""

    name = "sft"

    def __init__(self, work_dir: str | Path, total_steps: int, *, facts: Sequence[tuple[str, str]] = (),
                 every: int = 0, plot: bool = True):
        self.work_dir = Path(work_dir)
        self.total_steps = total_steps
        self.facts = list(facts)
        self.every = every if every > 0 else max(1, total_steps // 20)
        self.plot = plot
        self._first: Progress | None = None
        self._seen_layout = self._seen_params = self._seen_resume = False

    def header(self, log_path: Path) -> list[str]:
        lines = [say(f"{key:<11} {value}") for key, value in self.facts]
        lines.append(say(f"{'log':<11} {log_path} (verl, Megatron and torchrun output; VERBOSE=1 shows it here)"))
        return lines

    def on_line(self, line: str) -> list[str]:
        if PREFIX + " step " in line:
            return self._progress(line[line.index(PREFIX):])
        if not self._seen_layout and (m := LAYOUT_LINE.search(line)):
            self._seen_layout = True
            return [layout_fact(m)]
        if not self._seen_params and (m := _PARAMS.search(line)):
            self._seen_params = True
            return [say(f"{'parameters':<11} {m.group(1)}")]
        if not self._seen_resume and (m := _FOUND_CKPT.search(line)):
            self._seen_resume = True
            return [say(f"{'resume':<11} from step {m.group(2)} ({m.group(1)})")]
        if m := _SAVING.search(line):
            return [say(f"checkpoint  {m.group(1)}")]
        return []

    def _progress(self, line: str) -> list[str]:
        m = _PROGRESS.search(line)
        if m is None:
            return [line]
        p = Progress(int(m.group(1)), float(m.group(2)), float(m.group(3)), float(m.group(4)))
        if self._first is None:
            self._first = p
        done = p.step - self._first.step + 1
        last = p.step >= self.total_steps
        if not (p.step == self._first.step or last or p.step % self.every == 0):
            return []
        eta = (p.elapsed / done) * max(0, self.total_steps - p.step) if done > 0 else float("nan")
        return [say(
            f"step {p.step}/{self.total_steps} | loss {p.loss:.4f} | {p.tok_s:.0f} tok/s | "
            f"elapsed {format_duration(p.elapsed)} | ETA {format_duration(eta)}"
        )]

    def summary(self, log_path: Path, returncode: int, wall_s: float) -> list[str]:
        text = log_path.read_text(errors="replace")
        earlier = _history(log_path.parent, log_path) if _FOUND_CKPT.search(ANSI_ESCAPE.sub("", text)) else []
        summary = summarize_sft(text, self.total_steps, earlier=earlier)
        note = None
        if self.plot:
            note = plot_losses(summary.curve_steps, summary.curve_losses, self.work_dir / "loss.png",
                               resumed_from=summary.resumed_from, title=f"{self.work_dir.name}: loss per step")
        return sft_summary_lines(summary, wall_s=wall_s, log_path=log_path, plot_note=note)


def finished_run_lines(checkpoints: str | Path, total_steps: int, log_dir: str | Path | None = None) -> list[str] | None:
    """The console lines for a run whose latest checkpoint already reached ``total_steps``; None otherwise.

    verl's sft_trainer, resumed at its last step, trains one step past it (``step 81/80``); the launcher
    asks first and, for a finished run, says so (and shows the summary of its last log) instead.
    """
    checkpoints = Path(checkpoints)
    tracker = checkpoints / "latest_checkpointed_iteration.txt"
    try:
        step = int(tracker.read_text().strip())
    except (OSError, ValueError):
        return None
    folder = checkpoints / f"global_step_{step}"
    if step < total_steps or not folder.is_dir():
        return None
    lines = [
        say(f"{'resume':<11} from step {step} ({folder}): the run is complete ({step} of {total_steps} steps); "
            "nothing to train"),
        say(f"{'':<11} raise STEPS to train on (e.g. STEPS={2 * total_steps}), or start over with "
            "RESUME_MODE=disable or another WORK_DIR"),
    ]
    latest = Path(log_dir) / "latest.log" if log_dir is not None else None
    if latest is not None and latest.exists():
        last = latest.parent / latest.readlink() if latest.is_symlink() else latest
        summary = summarize_sft(last.read_text(errors="replace"), total_steps)
        lines += [say("(the last run's summary, from its log)")] + sft_summary_lines(summary, log_path=last)
    return lines
