"""The shipped long-context settings: a recipe, a mesh and ``ds4.max_seq_len``, each accepted at peak by the start-up check.

    python -m verl_ds4.recipes.long_context            # the table of docs/memory.md ("Long-context settings")
    python -m verl_ds4.recipes.long_context --check    # exit 1 when a setting's row no longer holds

Each :class:`Setting` is what a user launches (``MESH=... MAX_SEQ_LEN=... [MODEL_VERSION=v41] bash
scripts/run_deepseek_v4_flash_{sft,grpo}_megatron.sh``); the CP is the one ``ds4.max_seq_len`` derives on that mesh
(:mod:`verl_ds4.recipes.seq_cp`). :func:`judge` composes and validates it exactly as ``verl-ds4 recipe KIND --dry-run``
does (the derivation's refusals included) and reads the highest modelled peak. :func:`longest` finds the longest
multiple of :data:`STEP` tokens the setting trains at its CP (the table's "longest" column; ``longest`` in
:data:`SETTINGS` records it, and ``longest + STEP`` is refused: tests/test_long_context_settings_on_cpu.py).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

#: The granularity of the "longest sequence" search, in tokens.
STEP = 8192


@dataclass(frozen=True)
class Setting:
    name: str
    recipe: str  # a key of verl_ds4.recipes.compose.TRAINERS
    mesh: str
    max_seq_len: int  # the shipped length
    cp: int  # the CP ds4.max_seq_len derives on the mesh at max_seq_len
    longest: int  # the longest multiple of STEP accepted at peak at this CP (python -m verl_ds4.recipes.long_context)

    def overrides(self, n: int | None = None, pin_cp: bool = False) -> list[str]:
        return [f"ds4_mesh={self.mesh}", f"ds4.max_seq_len={n or self.max_seq_len}"] + ([f"ds4.mesh.cp={self.cp}"] if pin_cp else [])

    @property
    def launcher(self) -> str:
        kind = "sft" if self.recipe.endswith("sft") else "grpo"
        v41 = "MODEL_VERSION=v41 " if "v41" in self.recipe else ""
        return f"{v41}MESH={self.mesh} MAX_SEQ_LEN={self.max_seq_len} bash scripts/run_deepseek_v4_flash_{kind}_megatron.sh"


SETTINGS: tuple[Setting, ...] = (
    Setting("Flash GRPO, 64 H200", "grpo", "h200_64gpu_pp4_ep16_cp8", 32768, 8, 32768),
    Setting("Flash SFT, 64 H200", "sft", "h200_64gpu_pp4_ep16_cp8", 32768, 8, 122880),
    Setting("Flash GRPO, 64 GB200", "grpo", "gb200_64gpu_pp4_ep16_cp16", 131072, 16, 188416),
    Setting("Flash SFT, 64 GB200", "sft", "gb200_64gpu_pp4_ep16_cp16", 131072, 16, 532480),
    Setting("Flash GRPO, 128 GB300", "grpo", "gb300_128gpu_pp1_ep128_cp2", 131072, 2, 147456),
    Setting("Flash SFT, 128 GB300", "sft", "gb300_128gpu_pp1_ep128_cp2", 131072, 4, 204800),
    Setting("V4.1-Flash GRPO, 128 GB300", "deepseek_v41_grpo", "gb300_128gpu_pp1_ep128_cp2", 131072, 4, 147456),
)


@dataclass
class Verdict:
    accepted: bool
    cp: int
    peak_gib: float | None
    limit_gib: float | None
    errors: list[str]
    rollout: dict | None = None  # the rollout's weights, KV cache and share (RL recipes; MemoryReport.rollout)


def judge(setting: Setting, n: int | None = None, pin_cp: bool = False, extra: tuple[str, ...] = ()) -> Verdict:
    """Compose and validate ``setting`` at ``n`` tokens (default: its own length; ``extra``: more overrides), as the
    dry-run does."""
    from verl_ds4.recipes.compose import TRAINERS, compose_recipe, derivation
    from verl_ds4.recipes.validate import validate_recipe

    overrides = setting.overrides(n, pin_cp) + list(extra)
    cfg = compose_recipe(setting.recipe, overrides)
    report = validate_recipe(cfg, TRAINERS[setting.recipe].kind, dry_run=True, raise_on_error=False)
    errors = [str(p) for p in derivation(setting.recipe, overrides).problems + report.errors]
    memory = report.memory
    peaks = [rm.peak_gib for rm in memory.roles] + [g for name, g in memory.phases if name != "rollout"] if memory else []
    return Verdict(not errors, report.roles[0].cp, max(peaks) if peaks else None, memory.limit_gib if memory else None, errors,
                   memory.rollout if memory else None)


def longest(setting: Setting, cap: int = 1 << 20) -> int:
    """The longest multiple of :data:`STEP` the setting trains at its CP (0 when not even its own length)."""
    ok = lambda n: judge(setting, n, pin_cp=True).accepted  # noqa: E731
    if not ok(setting.max_seq_len):
        return 0
    lo, hi = setting.max_seq_len, setting.max_seq_len
    while hi < cap and ok(min(2 * hi, cap)):
        lo = hi = min(2 * hi, cap)
    if hi >= cap:
        return cap
    hi = min(2 * hi, cap)  # refused
    while hi - lo > STEP:
        mid = (lo + hi) // 2 // STEP * STEP
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def table(search: bool = False) -> tuple[str, bool]:
    """(the markdown table, whether every row holds: accepted at its length and at ``longest``, refused above it)."""
    lines = ["| setting | launch | CP | tokens/GPU x CP | peak at its length (GiB, limit) | rollout at its length: weights + KV "
             "cache (GiB, vLLM's share) | longest at its CP | peak there | longest + 8,192 |", "|---|---|---|---|---|---|---|---|---|"]
    ok = True
    for s in SETTINGS:
        shipped = judge(s)
        best = longest(s) if search else s.longest
        top, above = judge(s, best, pin_cp=True), judge(s, best + STEP, pin_cp=True)
        holds = shipped.accepted and shipped.cp == s.cp and top.accepted and not above.accepted and best == s.longest
        ok &= holds
        lines.append(
            f"| {s.name} | `{s.launcher}` | {shipped.cp} | {_budget(s)} | {s.max_seq_len:,}: {_gib(shipped)} | {_rollout(shipped)} | {best:,} | "
            f"{_gib(top)} | {_refusal(above)} |" + ("" if holds else " **does not hold**"))
    return "\n".join(lines), ok


def _refusal(v: Verdict) -> str:
    """``refused (peak)`` when the peak is over the limit, else ``refused (what refuses it)``, or ``ACCEPTED``."""
    if v.accepted:
        return "ACCEPTED"
    if v.peak_gib is not None and v.limit_gib is not None and v.peak_gib > v.limit_gib:
        return f"refused ({v.peak_gib:.1f})"
    return f"refused ({v.errors[0].split(':', 1)[0]})" if v.errors else "refused"


def _rollout(v: Verdict) -> str:
    r = v.rollout
    if not r or "kv_cache_gib" not in r:
        return "-"
    return (f"{r['weights_gib']:.1f} + {r['kv_cache_gib']:.1f} of {r['share_gib']:.1f} ({r['kv_sequences']} sequences "
            "per engine)")


def _gib(v: Verdict) -> str:
    return "-" if v.peak_gib is None else f"{v.peak_gib:.1f} of {v.limit_gib:.1f}" + ("" if v.accepted else " (refused)")


def _budget(s: Setting) -> str:
    from verl_ds4.recipes.compose import compose_recipe

    cfg = compose_recipe(s.recipe, s.overrides())
    return f"{cfg.ds4.max_token_len_per_gpu:,} x {s.cp}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_ds4.recipes.long_context", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a row does not hold (the recorded longest included)")
    parser.add_argument("--search", action="store_true", help="search each setting's longest length instead of the recorded one")
    args = parser.parse_args(argv)
    text, ok = table(search=args.search)
    print(text)
    if args.check and not ok:
        print("python -m verl_ds4.recipes.long_context: a setting does not hold (marked); update SETTINGS or the mesh.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
