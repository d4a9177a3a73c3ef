"""The shipped long-context settings (verl_ds4/recipes/long_context.py): each is accepted at peak at its length with
the CP it records and refused one step (8,192 tokens) above its recorded longest length at that CP;
the table in docs/memory.md is what ``python -m verl_ds4.recipes.long_context`` prints. Negative controls: the next
length up, and a setting without its lever (the H200 one with Megatron's own sparse-attention core) refused. About 20 s on CPU
(compositions and start-up checks, no model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from verl_ds4.recipes import long_context as lc

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("setting", lc.SETTINGS, ids=[s.name for s in lc.SETTINGS])
def test_setting_is_accepted_at_peak_and_the_next_length_up_is_refused(setting):
    shipped = lc.judge(setting)
    assert shipped.accepted and shipped.cp == setting.cp, shipped.errors
    assert shipped.peak_gib <= shipped.limit_gib
    assert setting.longest >= setting.max_seq_len  # the longest itself: `python -m verl_ds4.recipes.long_context --check`
    above = lc.judge(setting, setting.longest + lc.STEP, pin_cp=True)  # negative control: the next length up
    assert not above.accepted and any("memory" in e or "ds4.mesh.cp" in e for e in above.errors), above.errors


def test_without_its_lever_the_h200_setting_is_refused():
    setting = lc.SETTINGS[0]
    assert setting.mesh == "h200_64gpu_pp4_ep16_cp8"
    # the lever: verl-ds4's linear sparse attention (the mesh's); Megatron's own unfused core at its CP is refused
    no_lever = lc.judge(setting, pin_cp=True, extra=("ds4.sparse_attention=megatron",))
    assert not no_lever.accepted and any("ds4.mesh.cp: is 8" in e for e in no_lever.errors), no_lever.errors


def test_the_docs_table_is_the_generated_one():
    text = (REPO / "docs" / "memory.md").read_text()
    for s in lc.SETTINGS:
        row = next((line for line in text.splitlines() if line.startswith(f"| {s.name} |")), None)
        assert row is not None, f"docs/memory.md lacks the row of {s.name}: run python -m verl_ds4.recipes.long_context"
        assert f"`{s.launcher}`" in row and f"| {s.longest:,} |" in row and f"| {s.cp} |" in row, row
