"""docs/troubleshooting.md lists every user-facing refusal, and lists nothing the code no longer raises.

The collector and the matching rules: :mod:`verl_ds4.testing.error_catalogue`. Negative controls: a
message dropped from the page, a message the code does not raise, a reworded raise, a new raise in a
module, a new launcher refusal and an unmarked short message each make the check fail.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from verl_ds4.testing import error_catalogue as ec

PAGE = ec.PAGE


def _report_text(report: ec.Report) -> str:
    lines = [f"not on {PAGE.name}: {s.where()}: {s.example()}" for s in report.undocumented]
    lines += [f"too short (mark it '{ec.NOT_USER_FACING} why'): {s.where()}: {s.example()}" for s in report.short]
    lines += [f"{PAGE.name}:{n} is raised nowhere: {text}" for n, text in report.stale]
    return "\n".join(lines) + "\n(python -m verl_ds4.testing.error_catalogue prints the lines to paste)"


def test_every_refusal_is_on_the_page_and_every_listed_message_is_raised():
    report = ec.check()
    assert report.ok, _report_text(report)
    # The collector sees every kind of site in every part of the product a user meets.
    paths = {s.path for s in report.sites}
    for where in ("verl_ds4/recipes/validate.py", "verl_ds4/mcore/resolver.py", "verl_ds4/recipes/resume_check.py",
                  "verl_ds4/models/ds4/chat.py", "verl_ds4/ds41_facts.py", "scripts/cluster_lib.sh",
                  "scripts/run_ds4_proxy_ppo_cpu.sh", "verl_ds4/layout/plan_cli.py", "verl_ds4/verify/cli.py"):
        assert where in paths, where
    assert len(report.sites) >= 200, len(report.sites)
    for path in ec.SCOPE + ec.SHELL_SCOPE:
        assert (ec.REPO / path).is_file(), f"{path} is in the catalogue's scope but does not exist"


def test_the_known_refusals_are_collected_with_their_words():
    examples = {s.example() for s in ec.all_sites()}
    assert ("MINI_BATCH=<...>, BATCH=<...>: expected positive integers with MINI_BATCH dividing BATCH "
            "(BATCH / MINI_BATCH actor/critic updates per step), e.g. BATCH=8 MINI_BATCH=4") in examples
    assert any(e.startswith("data.filter_overlong_prompts: is True with verl's RLHFDataset, whose filter calls")
               for e in examples)  # a Problem(setting, message, fix)
    assert any("DS4's hybrid attention does not support tensor parallelism" in e for e in examples)  # a Violation
    assert "verl-ds4 plan: --cp is required for a layout plan (or use --fit to find meshes)." in examples  # CLI
    # Marked internal invariants are left out, and are still found when asked for.
    internal = {s.example() for s in ec.all_sites(include_internal=True)} - examples
    assert any("expected a ResolvedCPLayout" in e for e in internal), internal


def test_a_message_dropped_from_the_page_fails(tmp_path):
    text = PAGE.read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("MINI_BATCH=3, BATCH=8: expected positive integers"))
    page = tmp_path / "troubleshooting.md"
    page.write_text(text.replace(line + "\n", ""))
    report = ec.check(page)
    assert [s.path for s in report.undocumented] == ["scripts/run_ds4_proxy_ppo_cpu.sh"], _report_text(report)
    assert not report.stale


def test_a_listed_message_that_nothing_raises_fails(tmp_path):
    text = PAGE.read_text()
    anchor = "DTYPE=fp8: expected float32, bfloat16 or float16\n"
    page = tmp_path / "troubleshooting.md"
    page.write_text(text.replace(anchor, anchor + "QUANT=int4: expected fp8 or bf16\n"))
    report = ec.check(page)
    assert [t for _, t in report.stale] == ["QUANT=int4: expected fp8 or bf16"], _report_text(report)
    assert not report.undocumented


def test_a_reworded_raise_fails_both_ways():
    sites = ec.all_sites()
    [site] = [s for s in sites if s.literal.startswith("--limit must be >= 1")]
    reworded = ec.Site(site.path, site.line, tuple(p.replace("--limit must be >= 1", "--limit must be positive")
                                                   for p in site.parts))
    report = ec.check(sites=[s for s in sites if s is not site] + [reworded])
    assert report.undocumented == [reworded], _report_text(report)
    assert [t for _, t in report.stale] == ["--limit must be >= 1, got 0"], _report_text(report)


def test_a_new_raise_problem_or_launcher_refusal_is_collected(tmp_path):
    module = tmp_path / "new_check.py"
    module.write_text(textwrap.dedent('''
        import sys
        from verl_ds4.recipes.roles import Problem

        def check(cfg, parser):
            if cfg.x < 0:
                raise ValueError(f"ds4.x={cfg.x}: expected a non-negative count of widgets.")
            message = "ds4.y is set twice: keep one of the two settings."
            if cfg.y:
                raise RuntimeError(message)
            if cfg.z:
                raise RuntimeError(f"{cfg.z}")  # error-catalogue: internal: a test of the marker
            problems = [Problem("ds4.w", f"is {cfg.w}, more than the widget budget.", "lower it.")]
            if cfg.v:
                print(f"verl-ds4 widget: --v {cfg.v} names no widget", file=sys.stderr)
                return 2
            parser.error("give --widget or --gadget, not both")
    '''))
    sites = ec.python_sites(str(module))
    assert [s.example() for s in sites] == [
        "ds4.x=<...>: expected a non-negative count of widgets.",
        "ds4.y is set twice: keep one of the two settings.",
        "ds4.w: is <...>, more than the widget budget. Fix: lower it.",
        "verl-ds4 widget: --v <...> names no widget",
        "give --widget or --gadget, not both",
    ]
    report = ec.check(sites=ec.all_sites() + sites)
    assert report.undocumented == sites, _report_text(report)

    script = tmp_path / "launcher.sh"
    script.write_text(textwrap.dedent('''\
        [ -n "$WIDGETS" ] || ds4_die "WIDGETS is not set: export WIDGETS=4"
        if [ "$X" = 1 ]; then
            echo "X=$X: expected 0 or 2" \\
                 "(one of the two modes)" >&2
            exit 2
        fi
        echo "progress: $X" >&2
    '''))
    shell = ec.shell_sites(str(script))
    assert [s.example() for s in shell] == ["WIDGETS is not set: export WIDGETS=4",
                                           "X=<...>: expected 0 or 2 (one of the two modes)"]


def test_a_short_message_must_be_marked(tmp_path):
    module = tmp_path / "short.py"
    module.write_text('def f(e):\n    raise ValueError(f"bad: {e}")\n')
    sites = ec.python_sites(str(module))
    report = ec.check(sites=ec.all_sites() + sites)
    assert report.short == sites and not report.ok
    module.write_text('def f(e):\n    raise ValueError(f"bad: {e}")  # error-catalogue: passes on e\n')
    assert ec.python_sites(str(module)) == []


def test_the_cli_prints_what_is_missing(tmp_path, capsys):
    page = tmp_path / "troubleshooting.md"
    page.write_text(PAGE.read_text().replace("give exactly one of --lengths or --parquet (with --column)\n", ""))
    assert ec.main(["--page", str(page)]) == 1
    out = capsys.readouterr().out
    assert "not on the page: verl_ds4/layout/plan_cli.py:" in out
    assert "    give exactly one of --lengths or --parquet (with --column)" in out
    assert ec.main([]) == 0
