"""A quiet console for the CPU launchers: the full output goes to a log file, a person sees a summary.

:func:`run_quiet` runs a command (``torchrun ...`` or ``python -m verl.trainer.main_ppo ...``) with
stdout and stderr teed, byte for byte, to a log file in the run folder. The console shows only
what a :class:`ConsoleView` makes of the output: start-up facts, one progress line per step (or
every N steps) with an ETA, and a final summary. ``verbose=True`` also passes every byte through
to the console, as the launchers did before. On a non-zero exit the last lines of the log and its
path are printed, and the exit status is passed on.

:class:`SFTConsole` is the view of the SFT main job (``scripts/run_ds4_proxy_sft_cpu.sh``): it
reads the CPU engine's progress lines (:func:`verl_ds4.cpu.progress.progress_line`) and verl's
checkpoint prints; :func:`summarize_sft` turns a log into the summary (loss trend, tokens/s,
checkpoint, resume step) and says whether training worked; :func:`plot_losses` writes the loss
curve PNG (matplotlib, the ``plot`` extra). :class:`PPOConsole` is the view of the CPU PPO/GRPO
launcher (``scripts/run_ds4_proxy_ppo_cpu.sh``): one line per PPO step from verl's console metrics
(:func:`parse_step_metrics`) and the :func:`summary_table`. Nothing here imports verl, so the
console starts at once (importing ``verl_ds4.rollout`` would import verl first).

    python -m verl_ds4.cpu.console {sft|ppo} --work-dir W --steps 80 [--verbose] [--fact k=v ...] -- CMD...
    python -m verl_ds4.cpu.console --summarize LOG     # the summary of a finished run's log
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

__all__ = [
    "PREFIX",
    "SUMMARY_COLUMNS",
    "ConsoleView",
    "PPOConsole",
    "SFTConsole",
    "SFTSummary",
    "format_duration",
    "link_latest",
    "log_tail",
    "new_log_path",
    "parse_progress",
    "parse_step_metrics",
    "plot_losses",
    "ppo_summary_lines",
    "run_quiet",
    "say",
    "summarize_sft",
    "summary_table",
]

PREFIX = "[verl-ds4]"
TAIL_LINES = 40
MAX_TAIL_LINE = 1000  # characters of one log line in the failure tail (the rest stays in the log)
WINDOW = 20  # steps in the first/last loss means of the summary
#: Relative change of the mean loss (last window vs first) below which "the loss fell".
FELL_BELOW = -0.05

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_STEP_LINE = re.compile(r"(?:^|\s)step:(\d+) - (.*)$")
_ROLLOUT_READY = re.compile(r"(cpu_demo rollout server \d+ ready)")
_PROGRESS = re.compile(
    r"\[verl-ds4\] step (\d+) \| loss (\S+) \| (\S+) tok/s \| elapsed ([0-9.]+)s"
)
_FOUND_CKPT = re.compile(r"Found latest checkpoint: (\S+) \(step (\d+)\)")
_SAVING = re.compile(r"Saving checkpoint to: (\S+)")
_LAYOUT = re.compile(r"verl-ds4 (\w+): (\w+) CP layout \(([^)]*)\)")
_PARAMS = re.compile(r"DistributedDataParallel contains (\S+) parameters")
_VERL_TOKENS = re.compile(r"step:(\d+) - .*?train/global_tokens:([0-9.]+)")


def format_duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def new_log_path(log_dir: str | Path) -> Path:
    """``log_dir/<YYYYmmdd-HHMMSS>.log`` (a suffix when that name is taken)."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = log_dir / f"{stamp}.log", 1
    while path.exists():
        path, n = log_dir / f"{stamp}-{n}.log", n + 1
    return path


_TORCHRUN_FAILED = re.compile(r"torch/distributed/elastic/multiprocessing/api\.py:\d+\] (failed \(exitcode.*)$")


def log_tail(path: str | Path, lines: int = TAIL_LINES) -> list[str]:
    """The last ``lines`` lines of a log (ANSI codes and tqdm's carriage-return redraws removed).

    torchrun ends a failed run with a 40-line report of its own (its traceback and a table of the
    failed ranks) that would push the workers' error out of the tail: the tail then ends before that
    report, which is named in one line (it stays in the log).
    """
    path = Path(path)
    text = path.read_text(errors="replace") if path.exists() else ""
    all_lines = [line.rsplit("\r", 1)[-1] for line in _ANSI.sub("", text).splitlines()]
    report = None
    for i in range(len(all_lines) - 1, -1, -1):
        if m := _TORCHRUN_FAILED.search(all_lines[i]):
            report = f"(then torchrun's report: {m.group(1)}; {len(all_lines) - i} lines, in the log)"
            all_lines = all_lines[:i]
            break
    out = []
    for line in all_lines[-lines:]:
        if len(line) > MAX_TAIL_LINE:
            line = line[:MAX_TAIL_LINE] + f" ... ({len(line) - MAX_TAIL_LINE} more characters in the log)"
        out.append(line)
    return out + ([report] if report else [])


def say(text: str = "") -> str:
    """One console line of ours: ``[verl-ds4] text``."""
    return f"{PREFIX} {text}".rstrip()


# ------------------------------------------------------------------------------------- the runner


class ConsoleView:
    """What a person sees of a run. Subclasses turn log lines into console lines."""

    name = "run"

    def header(self, log_path: Path) -> list[str]:
        return [say(f"full log: {log_path}")]

    def on_line(self, line: str) -> list[str]:
        """Console lines for one output line (ANSI-free, one tqdm redraw at a time)."""
        return []

    def summary(self, log_path: Path, returncode: int, wall_s: float) -> list[str]:
        return [say(f"wall time {format_duration(wall_s)}; full log: {log_path}")]


def run_quiet(
    cmd: Sequence[str],
    log_path: str | Path,
    view: ConsoleView | None = None,
    *,
    verbose: bool = False,
    env: dict | None = None,
    cwd: str | Path | None = None,
    out=None,
) -> int:
    """Run ``cmd`` with its output teed to ``log_path``; print ``view``'s lines; return the exit status.

    The console (``out``, default ``sys.stdout``) gets the view's header, its lines for the output,
    and its summary; with ``verbose`` also the command's own output, unchanged. A non-zero exit adds
    the last :data:`TAIL_LINES` lines of the log and its path.
    """
    view = view or ConsoleView()
    out = out or sys.stdout
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)

    def emit(lines: Iterable[str]) -> None:
        for line in lines:
            out.write(line + "\n")
        out.flush()

    emit(view.header(log_path))
    env = dict(os.environ if env is None else env)
    env.setdefault("PYTHONUNBUFFERED", "1")  # a pipe would block-buffer the trainer's prints: progress arrives live
    start = time.monotonic()
    pending = ""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        try:
            fd = proc.stdout.fileno()
            while True:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                log.write(chunk)
                log.flush()
                if verbose:
                    out.flush()
                    raw = getattr(out, "buffer", None)
                    if raw is not None:
                        raw.write(chunk)
                        raw.flush()
                    else:
                        out.write(chunk.decode(errors="replace"))
                pending += chunk.decode(errors="replace")
                *segments, pending = re.split(r"[\r\n]", pending)
                for segment in segments:
                    emit(view.on_line(_ANSI.sub("", segment)))
            if pending:
                emit(view.on_line(_ANSI.sub("", pending)))
            returncode = proc.wait()
        except KeyboardInterrupt:
            proc.wait()  # the child is in our process group: it got the same SIGINT
            returncode = proc.returncode if proc.returncode else 130
    wall = time.monotonic() - start
    if returncode != 0:
        emit(
            [say(f"FAILED: {' '.join([Path(cmd[0]).name, *cmd[1:3]])} ... exited with status {returncode} after "
                 f"{format_duration(wall)}."),
             say(f"last lines of the full log (up to {TAIL_LINES}):")]
            + ["    " + line for line in log_tail(log_path)]
            + [say(f"FAILED (exit {returncode}); full log: {log_path}")]
        )
        return returncode
    emit(view.summary(log_path, returncode, wall))
    return 0


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
    for step, loss, rate, elapsed in _PROGRESS.findall(_ANSI.sub("", text)):
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
    text = _ANSI.sub("", text)
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
        if not self._seen_layout and (m := _LAYOUT.search(line)):
            self._seen_layout = True
            return [say(f"{'CP layout':<11} {m.group(2)} ({m.group(3)}), resolved by {m.group(1)}")]
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
        earlier = _history(log_path.parent, log_path) if _FOUND_CKPT.search(_ANSI.sub("", text)) else []
        summary = summarize_sft(text, self.total_steps, earlier=earlier)
        note = None
        if self.plot:
            note = plot_losses(summary.curve_steps, summary.curve_losses, self.work_dir / "loss.png",
                               resumed_from=summary.resumed_from, title=f"{self.work_dir.name}: loss per step")
        return sft_summary_lines(summary, wall_s=wall_s, log_path=log_path, plot_note=note)


# ------------------------------------------------------------------------------- the PPO/GRPO job

# (metric key in verl's console line, column title)
SUMMARY_COLUMNS = (
    ("critic/score/mean", "reward"),
    ("critic/vf_loss", "value_loss"),
    ("actor/kl_loss", "kl(actor|ref)"),
    ("actor/pg_loss", "pg_loss"),
    ("critic/values/mean", "value_mean"),
    ("response_length/mean", "resp_len"),
    ("timing_s/gen", "gen_s"),
    ("timing_s/step", "step_s"),
)


def parse_step_metrics(text: str) -> dict[int, dict[str, float]]:
    """``{step: {metric: value}}`` from verl's console logger lines (``step:N - a:1.0 - b:2 ...``)."""
    steps: dict[int, dict[str, float]] = {}
    for line in _ANSI.sub("", text).splitlines():
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

    def __init__(self, work_dir: str | Path, total_steps: int, *, facts=()):
        self.work_dir = Path(work_dir)
        self.total_steps = total_steps
        self.facts = list(facts)
        self._layouts: set[str] = set()
        self._ready = False
        self._start = time.monotonic()
        self._step_times: list[float] = []
        self._printed: set[int] = set()

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
                f"{format_duration(m.get('timing_s/step', float('nan')))} | elapsed "
                f"{format_duration(time.monotonic() - self._start)} | ETA {format_duration(eta)}"
            )]
        if (m := _LAYOUT.search(line)) and m.group(1) not in self._layouts:
            self._layouts.add(m.group(1))
            return [say(f"{'CP layout':<11} {m.group(2)} ({m.group(3)}), resolved by {m.group(1)}")]
        if not self._ready and (m := _ROLLOUT_READY.search(line)):
            self._ready = True
            return [say(f"{'rollout':<11} {m.group(1)}")]
        return []

    def summary(self, log_path: Path, returncode: int, wall_s: float) -> list[str]:
        metrics = parse_step_metrics(log_path.read_text(errors="replace"))
        return ppo_summary_lines(metrics, self.total_steps, self.work_dir / "checkpoints", wall_s=wall_s,
                                 log_path=log_path)


def ppo_summary_lines(metrics: dict[int, dict[str, float]], total_steps: int | None, ckpt_dir: Path | None = None,
                      *, wall_s: float | None = None, log_path: str | Path | None = None) -> list[str]:
    """The summary: a verdict on the RL path (not on learning: the model is random), the table, paths."""
    lines = [say("-" * 26 + " summary " + "-" * 26)]
    if not metrics:
        lines.append(say("result      NO PPO STEPS: no 'step:N - ...' metric line in the log"))
    else:
        last = max(metrics)
        bad = sorted({k for m in metrics.values() for k, v in m.items() if not math.isfinite(v)} & {
            k for k, _ in SUMMARY_COLUMNS})
        if total_steps and last < total_steps:
            verdict = f"INCOMPLETE: the run stopped at PPO step {last} of {total_steps}"
        elif bad:
            verdict = f"NOT FINITE: {', '.join(bad)}"
        else:
            verdict = (f"the RL path ran: {len(metrics)} PPO step{'s' * (len(metrics) != 1)} (rollout, reward, "
                       "values, GAE, updates, weight sync), all metrics finite; the model is random, so this "
                       "is not a test of learning")
        lines.append(say(f"result      {verdict}"))
        lines += [say("  " + row) for row in summary_table(metrics).splitlines()]
    if wall_s is not None:
        lines.append(say(f"wall time   {format_duration(wall_s)}"))
    if ckpt_dir is not None:
        tracker = Path(ckpt_dir) / "latest_checkpointed_iteration.txt"
        step = tracker.read_text().strip() if tracker.exists() else ""
        lines.append(say(f"checkpoint  {Path(ckpt_dir) / f'global_step_{step}' if step else 'none'}"))
    if log_path is not None:
        lines.append(say(f"full log    {log_path}"))
    return lines


# ---------------------------------------------------------------------------------------- the CLI


def _facts(items: Sequence[str]) -> list[tuple[str, str]]:
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--fact {item!r}: expected KEY=VALUE")
        out.append((key, value))
    return out


def link_latest(log_path: Path) -> None:
    latest = log_path.parent / "latest.log"
    try:
        if latest.is_symlink() or latest.exists():
            latest.unlink()
        latest.symlink_to(log_path.name)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, cmd = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(description="Run a CPU job with a quiet console (full output in a log file).")
    parser.add_argument("job", nargs="?", choices=["sft", "ppo"], help="the job's console view")
    parser.add_argument("--summarize", metavar="LOG", help="print the summary of a finished SFT run's log and exit")
    parser.add_argument("--work-dir", default=".", help="run folder (logs/ and loss.png go here)")
    parser.add_argument("--log", help="log file (default: WORK_DIR/logs/<timestamp>.log)")
    parser.add_argument("--steps", type=int, default=0, help="total training steps (for the ETA and the summary)")
    parser.add_argument("--every", type=int, default=0, help="print every N steps (0: about 20 lines per run)")
    parser.add_argument("--fact", action="append", default=[], metavar="KEY=VALUE", help="a start-up fact to print")
    parser.add_argument("--verbose", action="store_true", help="also show the full output on the console")
    parser.add_argument("--no-plot", action="store_true", help="do not write loss.png")
    args = parser.parse_args(argv)

    if args.summarize:
        summary = summarize_sft(Path(args.summarize).read_text(errors="replace"), args.steps or None)
        print("\n".join(sft_summary_lines(summary, log_path=args.summarize)))
        return 0 if summary.worked else 1
    if not cmd or not args.job:
        parser.error("expected a job and a command after `--` (or --summarize LOG)")
    log_path = Path(args.log) if args.log else new_log_path(Path(args.work_dir) / "logs")
    if not args.log:
        link_latest(log_path)
    if args.job == "ppo":
        view: ConsoleView = PPOConsole(args.work_dir, args.steps, facts=_facts(args.fact))
    else:
        view = SFTConsole(args.work_dir, args.steps, facts=_facts(args.fact), every=args.every,
                          plot=not args.no_plot)
    return run_quiet(cmd, log_path, view, verbose=args.verbose)


if __name__ == "__main__":
    raise SystemExit(main())
