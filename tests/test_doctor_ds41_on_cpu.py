"""`verl-ds4 doctor`'s DeepSeek-V4.1 line: which V4.1 modules the stack has, what it lacks, and the fix (<1 s
for the fakes; one in-process doctor run ~5 s, it imports verl).

The module sources are faked (megatron-core 0.16.1 here has no V4.1): a stack with every piece and a CSA2
that takes CP passes; each negative control removes or breaks one piece and is named as missing.
"""

from __future__ import annotations

import argparse

import pytest

from verl_ds4.engine import doctor_cli as d

CSA2_CP = "class CSA2Attention(MegatronModule):\n    ...  # contiguous CP, halo exchange\n"
FULL = {
    d.DS41_CSA2_MODULE: CSA2_CP,
    d.DS41_CONFIG_MODULE: "class TransformerConfig:\n    dsv4_version: str = 'v4'\n",
    d.DS41_MODEL_MODULE: "from .config import DeepSeekV41Config\n",
    d.DS41_BRIDGE_MODULE: "class DeepSeekV41Bridge: ...\n",
}


def fake(sources):
    return lambda name: sources.get(name)


def test_a_stack_with_every_v41_piece_can_run_it():
    found, missing = d.ds41_cp_report([], fake(FULL))
    assert missing == []
    assert found[0].endswith("CSA2Attention (contiguous CP, told by PackedSeqParams.cp_partition_mode)")
    assert d.DS41_BRIDGE_MODULE in found and "TransformerConfig.dsv4_version" in found


@pytest.mark.parametrize(
    "change, expected",
    [
        ({d.DS41_CSA2_MODULE: None}, "no V4.1 CSA2 core attention"),
        ({d.DS41_CSA2_MODULE: "class CSA3Attention(MegatronModule): ..."}, "no V4.1 CSA2 core attention"),
        ({d.DS41_CSA2_MODULE: "class CompressedSparseAttention2(MegatronModule):\n  'Native CSA2 currently requires TP=CP=1.'"},
         "CompressedSparseAttention2 refuses context parallelism on this commit ('requires TP=CP=1')"),
        ({d.DS41_CONFIG_MODULE: "class TransformerConfig: ..."}, "no dsv4_version"),
        ({d.DS41_MODEL_MODULE: None}, "no megatron.core.models.deepseek_v41"),
        ({d.DS41_BRIDGE_MODULE: None}, "no DeepSeek-V4.1 bridge"),
    ],
)
def test_each_missing_piece_is_named(change, expected):
    _, missing = d.ds41_cp_report([], fake({**FULL, **change}))
    assert len(missing) == 1 and expected in missing[0]


def test_v4_gaps_are_v41_gaps_too():
    _, missing = d.ds41_cp_report(["TransformerEngine >= 2.9 is not installed"], fake(FULL))
    assert missing == ["TransformerEngine >= 2.9 is not installed"]


def test_module_source_reads_modules_and_packages():
    assert "def ds41_cp_report" in d.module_source("verl_ds4.engine.doctor_cli")
    assert "def exchange_left_halo" in d.module_source("verl_ds4.models.ds4")  # a package: every .py in it
    assert d.module_source("verl_ds4.no_such_module") is None


def test_doctor_prints_the_v41_line_and_require_ds41_fails_here(capsys):
    args = argparse.Namespace(require_ds4=False, require_ds41=True)
    status = d.run(args)
    out = capsys.readouterr().out
    block = out.split("DeepSeek-V4.1 with context parallelism on this stack:")[1]
    assert block.splitlines()[1].startswith("  NO; V4.1 modules found: none")
    assert "no V4.1 CSA2 core attention" in block and "fix: install a megatron.core with V4.1 (the dev commit 0d4c86d17" in block
    assert status == 1
