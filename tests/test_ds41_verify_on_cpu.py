"""``verl-ds4 verify --model ds41 --cp 2``: one training step of the tiny V4.1 in Megatron-Core at CP 1 and 2
against CP 1 and NeMo Automodel 0.7.0 at fp64 (``verl_ds4.verify.ds41``), with its negative controls.

* the CLI at CP 2 exits 0; every comparison row is within 1e-10 (loss, log-probs, entropy, gradients per
  group: Full / Reindex / Reuse / window-only attention, Engram tables, the rest; the Megatron wrapper's
  gradients against NeMo's directly at CP 1); every control row differs by > 1e-3 or was refused;
* negative controls of the harness itself: with the Engram halo or the CSA2 halo zeroed in the main
  run, the CP 2 vs CP 1 rows fail (loss, log-probs, gradients); the same figures against a tolerance
  no fp64 computation meets fail; the zigzag guard of the decoder raises on zigzag rows;
* the DSpark hook: without ``verl_ds4.verify.ds41_dspark`` the rows say "not built"; a module
  providing ``compare_dspark_with_nemo`` / ``dspark_rows`` adds its rows (a failing one fails the table);
* the CLI refuses options ds41 would ignore, and exits 2 without the reference.

Cost on the 2 shared cores: ~1-2 minutes (the CLI run ~20 s plus imports, two broken CP 2 steps ~5 s each).
"""

from __future__ import annotations

import json

import pytest
import torch

from verl_ds4.testing import ds41_reference as ref

pytestmark = pytest.mark.skipif(ref.reference_missing() is not None, reason=str(ref.reference_missing()))


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    from verl_ds4.cli import main

    out = tmp_path_factory.mktemp("ds41verify") / "cp2.json"
    code = main(["verify", "--model", "ds41", "--cp", "2", "--json", str(out)])
    return code, json.loads(out.read_text())


def test_cli_cp2_passes_with_every_row(cli_run):
    code, result = cli_run
    rows = {r["quantity"]: r for r in result["rows"]}
    assert code == 0 and result["passed"], [q for q, r in rows.items() if not r["passed"]]
    names = list(rows)
    for needed in ("CP=2 vs CP=1: loss", "CP=2 vs CP=1: log_probs", "CP=2 vs CP=1: entropy", "CP=1 vs NeMo: logits",
                   "CP=1 vs NeMo: log_probs", "CP=1 vs NeMo: loss", "CP=2 vs NeMo: logits", "CP=2 vs NeMo: log_probs"):  # fmt: skip
        assert needed in rows, needed
    for prefix in ("CP=2 vs CP=1: grads", "CP=1 vs NeMo: grads"):
        groups = [q for q in names if q.startswith(prefix)]
        for part in ("attn Full 2,5", "attn Reindex 3,6", "attn Reuse 4,7", "attn window-only 0,1", "Engram tables 1,3",
                     "Engram proj + norms 1,3", "hc", "router", "experts", "shared_experts", "norms", "embeddings", "output_layer"):  # fmt: skip
            assert any(f"grads {part}" in q for q in groups), (prefix, part)
        assert "frozen indexer" in next(q for q in groups if "attn Full" in q)  # indexer: no grad on either side
    matches = [r for r in result["rows"] if r["expect"] == "match"]
    assert len(matches) >= 35 and all(r["max_rel"] <= 1e-10 for r in matches)
    controls = [r for r in result["rows"] if r["expect"] in ("differ", "error")]
    # Engram halo / readers recompute / zigzag (x2 each), and the DSpark loss training its drafter
    assert len(controls) == 7 and all(r["passed"] for r in controls)
    assert all(r["max_rel"] > 1e-3 for r in controls if r["expect"] == "differ")
    assert any(q.startswith("CP=2 vs CP=1: indexer loss: none in V4.1") for q in names)
    dspark = [q for q in names if q.startswith("DSpark")]
    for needed in ("DSpark loss, CP=1 vs NeMo", "DSpark loss, CP=2 vs CP=1", "DSpark drafter gradients, CP=2 vs CP=1",
                   "DSpark drafter tensors the DSpark loss trains"):  # fmt: skip
        assert any(q.startswith(needed) for q in dspark), (needed, dspark)
    print("\n".join(f"{r['quantity']}: {r['max_rel']:.1e}" for r in result["rows"] if r["expect"] != "absent"))
    print(f"verify --model ds41 --cp 2: {result['seconds']:.1f} s, stages {result['stages']}")


def test_cli_negative_controls_fail_against_an_impossible_tolerance(cli_run, monkeypatch, capsys):
    """The same run's figures against rtol 1e-30: every match row with a non-zero difference fails."""
    from verl_ds4.cli import main
    from verl_ds4.verify import ds41 as verify_ds41
    from verl_ds4.verify.parity import Row

    _, result = cli_run
    rows = [Row(r["quantity"], r["max_abs"], r["max_rel"], 1e-30 if r["expect"] == "match" else r["tol"], r["expect"]) for r in result["rows"]]
    monkeypatch.setattr(verify_ds41, "run_ds41_verify", lambda cp, **kw: {"rows": rows, "seconds": 0.0, "stages": {}, "lengths": result["lengths"]})
    assert main(["verify", "--model", "ds41", "--cp", "2"]) == 1
    assert "FAIL (<= 1e-30)" in capsys.readouterr().out


@pytest.fixture(scope="module")
def case_and_nemo():
    from verl_ds4.verify import ds41 as v

    case, theirs, ours = v.build_case()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as run_ds41_verify: NeMo's tiny scatter_adds crawl with 2 threads on busy cores
    try:
        return case, v.nemo_step(case, theirs, ours)
    finally:
        torch.set_num_threads(threads)


def _broken_rank_rows(case, nemo, module_name: str):
    """CP 1 correct, CP 2 with ``module_name``'s left halo replaced by zeros (forked ranks inherit the patch)."""
    import importlib

    from verl_ds4.verify import ds41 as v

    module = importlib.import_module(module_name)
    runs = {1: v.ours_on_cp_ranks(case, 1)}
    original = module.exchange_left_halo
    module.exchange_left_halo = lambda rows, count, group: rows.new_zeros(count, *rows.shape[1:])
    try:
        runs[2] = v.ours_on_cp_ranks(case, 2)
    finally:
        module.exchange_left_halo = original
    return {r.quantity: r for r in v.ds41_rows(case, nemo, runs, 2)}


@pytest.mark.parametrize("module_name", ["verl_ds4.models.ds41.engram", "verl_ds4.models.ds41.csa2"])
def test_a_broken_halo_fails_the_table(case_and_nemo, module_name):
    case, nemo = case_and_nemo
    rows = _broken_rank_rows(case, nemo, module_name)
    failed = {q: r.max_rel for q, r in rows.items() if not r.passed}
    print(f"{module_name} halo zeroed: {len(failed)} rows fail, e.g. " + ", ".join(f"{q} {e:.1e}" for q, e in list(failed.items())[:4]))
    for q in ("CP=2 vs CP=1: loss", "CP=2 vs CP=1: log_probs", "CP=2 vs NeMo: logits", "CP=2 vs NeMo: log_probs"):
        assert q in failed and failed[q] > 1e-4, (q, rows[q].max_rel)
    assert all(not q.startswith("CP=1 ") for q in failed)  # CP 1 has no halo: untouched
    if module_name.endswith("engram"):
        assert any("grads Engram tables" in q for q in failed)
    else:
        assert any("grads attn Full" in q for q in failed)


def test_the_linear_sparse_core_matches_nemo_at_cp1_and_cp2(case_and_nemo):
    """verify --model ds41 --sparse-core linear: CSA2's top-k layers (shared and reused KV) through
    verl_ds4.kernels.linear_sparse_attn equal NeMo Automodel at fp64, at CP 1 and CP 2. Control: the core with
    a shifted sink fails the NeMo rows."""
    from verl_ds4.verify import ds41 as v

    case, nemo = case_and_nemo
    runs = {size: v.ours_on_cp_ranks(case, size, sparse_core="linear") for size in (1, 2)}
    rows = v.ds41_rows(case, nemo, runs, 2)
    assert all(r.passed for r in rows), [(r.quantity, r.max_rel) for r in rows if not r.passed]
    assert any(r.quantity.startswith("CP=2 vs NeMo: log_probs") for r in rows)

    import verl_ds4.models.ds41.csa2 as csa2

    original = csa2.linear_sparse_attn
    csa2.linear_sparse_attn = lambda q, kv, sink, ids, scale, **kw: original(q, kv, sink + 0.05, ids, scale, **kw)
    try:
        broken = v.ds41_rows(case, nemo, {1: v.ours_on_cp_ranks(case, 1, sparse_core="linear"), 2: runs[2]}, 2)
    finally:
        csa2.linear_sparse_attn = original
    assert "CP=1 vs NeMo: log_probs" in {r.quantity for r in broken if not r.passed}


def test_the_decoder_refuses_zigzag_rows():
    from verl_ds4.models.ds41.mcore_model import DS41TransformerBlock

    DS41TransformerBlock.check_cp_partition("contiguous", 4)
    DS41TransformerBlock.check_cp_partition("zigzag", 1)  # no split at CP 1
    for mode in ("zigzag", None):
        with pytest.raises(ValueError, match="contiguous split.*cp_partition_mode"):
            DS41TransformerBlock.check_cp_partition(mode, 2)


def test_dspark_rows(monkeypatch):
    from verl_ds4.verify import ds41 as v
    from verl_ds4.verify import ds41_dspark as dspark
    from verl_ds4.verify.parity import rows_passed

    entries = [{"check": "loss, CP=2 vs CP=1 (rel)", "value": 3e-16, "limit": 1e-10},
               {"check": "drafter tensors the DSpark loss trains", "value": 40, "limit": None}]  # fmt: skip
    monkeypatch.setattr(dspark, "compare_dspark_with_nemo", lambda cp, seed, timeout: {"cp": cp})
    monkeypatch.setattr(dspark, "dspark_rows", lambda result, rtol: entries)
    rows = v.dspark_rows(2, 1, 60.0, 1e-10)
    assert [r.quantity for r in rows] == ["DSpark loss, CP=2 vs CP=1 (rel)", "DSpark drafter tensors the DSpark loss trains"]
    assert rows_passed(rows)
    entries[0]["value"] = 1e-3  # negative control: a DSpark row above its limit fails the table
    entries[1]["value"] = 0  # and a drafter the loss does not train
    assert [r.passed for r in v.dspark_rows(2, 1, 60.0, 1e-10)] == [False, False]


def test_cli_refusals(monkeypatch, capsys):
    from verl_ds4.cli import main
    from verl_ds4.models.ds41 import reference

    for extra, words in ((["--dtype", "fp32"], "--dtype fp32: --model ds41 runs in fp64 only"),
                         (["--config", "{}"], "--config:"), (["--cp", "0"], "--cp 0: give N >= 1"),
                         (["--hf-checkpoint", "x"], "x has no config.json")):  # fmt: skip  (a V4.1 folder: verify_ds41_hf)
        args = ["verify", "--model", "ds41", *(["--cp", "2"] if "--cp" not in extra else []), *extra]
        assert main(args) == 2, extra
        assert words in capsys.readouterr().err, extra
    monkeypatch.setattr(reference, "reference_missing", lambda: "NeMo Automodel 0.7.0 is not installed: pip install ...")
    assert main(["verify", "--model", "ds41", "--cp", "2"]) == 2
    assert "pip install" in capsys.readouterr().err


def test_indexer_replay_rows_and_their_control(case_and_nemo):
    """verify --model ds41 --indexer-replay on: each step replays the indexer choices its own no-grad forward recorded
    (Full and Reindex layers; the Reuse layers take them), CP 2 vs CP 1 and both vs NeMo at fp64 (the native
    choice replayed is the native step). Control: replaying other valid blocks changes the log-probs (row must differ)."""
    from verl_ds4.models.ds41.mcore_model import ds41_transformer_config
    from verl_ds4.verify import ds41 as v

    case, nemo = case_and_nemo
    runs = {1: v.ours_on_cp_ranks(case, 1, replay=True), 2: v.ours_on_cp_ranks(case, 2, controls=True, replay=True)}
    with pytest.raises(ValueError) as refused:
        ds41_transformer_config(case.text, torch.float64, 2, cp_partition_mode="zigzag")
    rows = {r.quantity: r for r in v.ds41_rows(case, nemo, runs, 2, zigzag_config_error=str(refused.value), tag="+replay")}
    assert all(r.passed for r in rows.values()), [(q, r.max_rel) for q, r in rows.items() if not r.passed]
    for q in ("CP=2+replay vs CP=1+replay: log_probs", "CP=1+replay vs NeMo: log_probs", "CP=2+replay vs NeMo: logits"):
        assert rows[q].max_rel <= 1e-10, q
    control = rows["CP=2+replay control: indexer replay of other valid blocks: log_probs must differ"]
    assert control.expect == "differ" and control.max_rel > 1e-3
