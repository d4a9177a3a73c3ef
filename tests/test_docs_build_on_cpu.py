"""The documentation site builds in strict mode, with every page, and the strict build can fail.

``mkdocs.yml`` sets ``strict: true`` and ``validation`` so that a link to a missing page, a link to a
missing heading and a page left out of ``nav`` are errors. The build runs as ``python -m mkdocs build
--strict`` with the proxies pointed at a closed local port, so anything that tried to fetch from the
network would fail instead of passing on a connected machine. The negative controls copy ``docs/``
and ``mkdocs.yml`` into a temporary folder, break one thing each, and require the build to fail
naming it; the unmodified copy must build (so the failures come from the breakage).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CONFIG = ROOT / "mkdocs.yml"
DEAD_PROXY = "http://127.0.0.1:9"  # the discard port: nothing listens, every fetch through it fails


def _offline_env() -> dict[str, str]:
    env = dict(os.environ)
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        env[name] = DEAD_PROXY
    env.pop("NO_PROXY", None)
    env.pop("no_proxy", None)
    return env


def build(config: Path, site: Path) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir", str(site)],
        cwd=config.parent, env=_offline_env(), capture_output=True, text=True, timeout=300,
    )
    return proc, time.perf_counter() - start


def page_html(site: Path, page: Path) -> Path:
    """Where mkdocs (use_directory_urls) writes ``page``: ``index.md`` -> ``index.html``, ``x.md`` -> ``x/index.html``."""
    rel = page.relative_to(DOCS).with_suffix("")
    return site / ("index.html" if rel.name == "index" else rel / "index.html")


def test_config_is_strict_and_validates_links_anchors_and_nav():
    text = CONFIG.read_text()
    assert re.search(r"^strict:\s*true\s*$", text, re.M)
    assert re.search(r"^docs_dir:\s*docs\s*$", text, re.M)
    for key in ("omitted_files", "not_found", "anchors", "unrecognized_links", "absolute_links"):
        assert re.search(rf"^\s+{key}:\s*warn\b", text, re.M), f"validation.{key} must be warn (an error under strict)"
    assert "/site/" in (ROOT / ".gitignore").read_text().splitlines()


def test_docs_build_strict_with_every_page(tmp_path):
    site = tmp_path / "site"
    proc, seconds = build(CONFIG, site)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pages = sorted(DOCS.rglob("*.md"))
    assert len(pages) >= 13, pages
    missing = [str(p.relative_to(DOCS)) for p in pages if not page_html(site, p).is_file()]
    assert not missing, f"pages not in the built site: {missing}"
    index = (site / "index.html").read_text()
    unlinked = [p.name for p in pages if p.name != "index.md" and f'href="{p.stem}/"' not in index]
    assert not unlinked, f"docs/index.md does not link: {unlinked}"
    print(f"mkdocs build --strict: {seconds:.2f} s for {len(pages)} pages")


def _copy_docs(tmp_path: Path) -> Path:
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(CONFIG, tmp_path / "mkdocs.yml")
    return tmp_path / "mkdocs.yml"


BREAKAGES = {
    "broken link": (
        lambda docs: (docs / "quickstart.md").write_text(
            (docs / "quickstart.md").read_text() + "\nSee [the missing page](no-such-page.md).\n"),
        "no-such-page.md",
    ),
    "missing anchor": (
        lambda docs: (docs / "quickstart.md").write_text(
            (docs / "quickstart.md").read_text() + "\nSee [memory](memory.md#no-such-heading).\n"),
        "no-such-heading",
    ),
    "page not in nav": (
        lambda docs: (docs / "orphan.md").write_text("# An orphan page\n"),
        "orphan.md",
    ),
}


@pytest.mark.parametrize("breakage", [None, *BREAKAGES])
def test_strict_build_fails_on_each_breakage(tmp_path, breakage):
    config = _copy_docs(tmp_path / "copy")
    if breakage is not None:
        BREAKAGES[breakage][0](config.parent / "docs")
    proc, _ = build(config, tmp_path / "site")
    output = proc.stdout + proc.stderr
    if breakage is None:  # the copy itself builds: a failure below is the breakage's
        assert proc.returncode == 0, output
        return
    assert proc.returncode != 0, f"strict build passed despite a {breakage}:\n{output}"
    assert BREAKAGES[breakage][1] in output, output
