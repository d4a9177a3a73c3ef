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

The pieces: :mod:`.console_run` (the runner), :mod:`.console_sft` and :mod:`.console_ppo` (the views);
this module is their command line and re-exports their public names.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from verl_ds4.cpu.console_run import ConsoleView, PREFIX, format_duration, log_tail, new_log_path, run_quiet, say
from verl_ds4.cpu.console_sft import (SFTConsole, SFTSummary, finished_run_lines, parse_progress, plot_losses,
                                      sft_summary_lines, summarize_sft)
from verl_ds4.cpu.console_ppo import PPOConsole, SUMMARY_COLUMNS, parse_step_metrics, ppo_summary_lines, summary_table

__all__ = [
    "PREFIX",
    "SUMMARY_COLUMNS",
    "ConsoleView",
    "PPOConsole",
    "SFTConsole",
    "SFTSummary",
    "finished_run_lines",
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
    parser.add_argument("--no-plot", action="store_true", help="do not write loss.png (sft) / rl_metrics.png (ppo)")
    parser.add_argument("--algo", choices=["ppo", "grpo"], default="ppo", help="ppo job: the RL algorithm (ppo or grpo)")
    parser.add_argument("--from-checkpoint", action="store_true",
                        help="ppo job: the run started from a given checkpoint (MODEL_PATH), not the random model")
    parser.add_argument("--finished-check", metavar="CHECKPOINTS",
                        help="sft job: if the latest checkpoint in CHECKPOINTS reached --steps, say so and exit 0 "
                             "without running (verl would train one step past the end)")
    parser.add_argument("--reward-rise", type=float, metavar="X",
                        help="ppo job: the verdict says whether the last-5 mean reward beat the first-5 mean by X")
    args = parser.parse_args(argv)

    if args.summarize:
        summary = summarize_sft(Path(args.summarize).read_text(errors="replace"), args.steps or None)
        print("\n".join(sft_summary_lines(summary, log_path=args.summarize)))
        return 0 if summary.worked else 1
    if not cmd or not args.job:
        parser.error("expected a job and a command after `--` (or --summarize LOG)")
    if args.job == "sft" and args.finished_check and args.steps:
        done = finished_run_lines(args.finished_check, args.steps, Path(args.work_dir) / "logs")
        if done is not None:
            print("\n".join([say(f"{key:<11} {value}") for key, value in _facts(args.fact)] + done))
            return 0
    log_path = Path(args.log) if args.log else new_log_path(Path(args.work_dir) / "logs")
    if not args.log:
        link_latest(log_path)
    if args.job == "ppo":
        view: ConsoleView = PPOConsole(args.work_dir, args.steps, facts=_facts(args.fact), algo=args.algo,
                                       from_checkpoint=args.from_checkpoint, reward_rise=args.reward_rise,
                                       plot=not args.no_plot)
    else:
        view = SFTConsole(args.work_dir, args.steps, facts=_facts(args.fact), every=args.every,
                          plot=not args.no_plot)
    return run_quiet(cmd, log_path, view, verbose=args.verbose)


if __name__ == "__main__":
    raise SystemExit(main())
