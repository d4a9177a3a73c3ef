"""The CPU substitutes' pieces that need no Megatron-LM dev: the one list and its page, the exact Hadamard rotation,
the dev-tree checks, the undoable patches and the float64 precision rules (verl_ds4/substitutes).

The substitutes' effect on the whole model (equal to transformers, CP-exact) is proven by the production-path tests
(lane 2); these are their unit checks, each with a control that fails.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from verl_ds4.substitutes import megatron_dev
from verl_ds4.substitutes.hadamard import hadamard_matrix, rotate_activation
from verl_ds4.substitutes.patching import Patches
from verl_ds4.substitutes.precision import PromoteFloat32ToFloat64, float_keeps_float64, install_stable_topk, stable_topk
from verl_ds4.substitutes.registry import SUBSTITUTES

ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def _documented(text: str) -> set[str]:
    start = text.index("## The production path on a CPU")
    section = text[start : text.index("\n## ", start + 5)]
    return {m.group(1).strip() for m in re.finditer(r"^\| ([^|]+?) \|", section, re.M)} - {"substitute", "---"}


def test_the_architecture_page_lists_every_substitute():
    names = {s.name for s in SUBSTITUTES}
    text = ARCHITECTURE.read_text()
    assert _documented(text) == names
    # control: a table that lost a row is noticed
    dropped = text.replace("| Hadamard rotation |", "| (removed) |")
    assert _documented(dropped) != names


def test_every_substitute_says_what_it_replaces_and_how_it_is_checked():
    for s in SUBSTITUTES:
        assert s.replaces and s.stand_in and s.why and s.checked, s


def test_hadamard_rotation_is_orthonormal_and_its_own_inverse():
    h = hadamard_matrix(16, torch.float64, "cpu")
    assert torch.equal(h @ h.T, 16 * torch.eye(16, dtype=torch.float64))
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    assert torch.allclose(rotate_activation(rotate_activation(x)), x, rtol=0, atol=1e-14)
    assert torch.allclose(rotate_activation(x).norm(dim=-1), x.norm(dim=-1), rtol=1e-14, atol=0)
    x.requires_grad_(True)
    assert torch.autograd.gradcheck(rotate_activation, (x,))
    # the natural (Sylvester) order: the first row is all ones, as fast_hadamard_transform's
    assert torch.equal(h[0], torch.ones(16, dtype=torch.float64)) and torch.equal(h[1, :2], torch.tensor([1.0, -1.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_matrix(12, torch.float64, "cpu")


def test_hadamard_rotation_equals_fast_hadamard_transform_where_it_runs():
    fht = pytest.importorskip("fast_hadamard_transform", reason="fast_hadamard_transform (CUDA only) is not installed here")
    if not torch.cuda.is_available():
        pytest.skip("fast_hadamard_transform needs a CUDA device")
    x = torch.randn(4, 128, device="cuda", dtype=torch.bfloat16)
    ref = fht.hadamard_transform(x, scale=128**-0.5)
    assert torch.allclose(rotate_activation(x.double()).to(ref.dtype), ref, rtol=2e-2, atol=2e-2)


def test_an_unproven_commit_is_refused():
    with pytest.raises(megatron_dev.MegatronDevError, match="not one the production path was proven on"):
        megatron_dev.unpack("0123456789abcdef")
    assert not megatron_dev.available("0123456789abcdef")


def test_a_tree_of_another_commit_is_refused(tmp_path, monkeypatch):
    (tmp_path / "megatron" / "core").mkdir(parents=True)
    (tmp_path / "COMMIT").write_text("deadbeef" * 5 + "\n")
    monkeypatch.setenv("MEGATRON_DEV_DIR", str(tmp_path))
    with pytest.raises(megatron_dev.MegatronDevError, match="is commit deadbeef"):
        megatron_dev.find()
    # control: the same tree naming a proven commit is accepted
    (tmp_path / "COMMIT").write_text(megatron_dev.DEFAULT_COMMIT + "\n")
    assert megatron_dev.find().root == tmp_path


def test_a_dev_dir_without_megatron_core_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_DEV_DIR", str(tmp_path))
    with pytest.raises(megatron_dev.MegatronDevError, match="holds no megatron/core"):
        megatron_dev.find()
    assert not megatron_dev.available()


def test_dev_cannot_replace_an_imported_megatron(tmp_path):
    import megatron.core  # noqa: F401  (the released one, imported by this test process)

    tree = megatron_dev.MegatronDevTree(tmp_path, megatron_dev.DEFAULT_COMMIT)
    before = list(sys.path)
    with pytest.raises(megatron_dev.MegatronDevError, match="already imported"):
        megatron_dev.use(tree)
    assert sys.path == before


def test_patches_undo_in_reverse_order():
    class Owner:
        a = 1

    patches = Patches()
    patches.set(Owner, "a", 2)
    patches.set(Owner, "a", 3)
    patches.set(Owner, "b", 4)  # a new attribute
    assert (Owner.a, Owner.b, len(patches)) == (3, 4, 3)
    patches.undo()
    assert Owner.a == 1 and not hasattr(Owner, "b") and len(patches) == 0


def test_float64_rules():
    x = torch.ones(2, dtype=torch.float64)
    with PromoteFloat32ToFloat64():
        assert x.float().dtype == torch.float64 and torch.zeros(1, dtype=torch.float32).dtype == torch.float64
    assert x.float().dtype == torch.float32  # control: outside the mode a float64 tensor is cast
    patches = Patches()
    float_keeps_float64(patches)
    try:
        assert x.float().dtype == torch.float64 and torch.ones(1, dtype=torch.float16).float().dtype == torch.float32
    finally:
        patches.undo()
    assert x.float().dtype == torch.float32


def test_stable_topk_is_torch_topk_with_ties_in_index_order():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 50, generator=gen, dtype=torch.float64)  # no ties: exactly torch.topk
    for dim, largest in ((-1, True), (-1, False), (0, True)):
        ours, theirs = stable_topk(x, 4, dim=dim, largest=largest), torch.topk(x, 4, dim=dim, largest=largest)
        assert torch.equal(ours.values, theirs.values) and torch.equal(ours.indices, theirs.indices)
    # ties (a ReLU indexer's zeros): the lowest indices first, whatever the shape
    tied = torch.tensor([[0.0, 2.0, 0.0, 0.0, 1.0] + [0.0] * 120])
    picked = stable_topk(tied, 5)
    assert picked.values.tolist() == [[2.0, 1.0, 0.0, 0.0, 0.0]]
    assert picked.indices.tolist() == [[1, 4, 0, 2, 3]]
    # process-wide, and undone
    patches = Patches()
    install_stable_topk(patches)
    try:
        assert torch.topk(tied, 5).indices.tolist() == [[1, 4, 0, 2, 3]] == tied.topk(5).indices.tolist()
    finally:
        patches.undo()
    assert torch.topk is not stable_topk and torch.Tensor.topk is not None


def test_the_mtp_fix_applies_only_while_dev_normalises_per_rank():
    from verl_ds4.substitutes.upstream_fixes import mtp_loss_is_rank_mean

    def dev_like(loss_mask, mtp_loss, mtp_loss_scale):
        num_tokens = loss_mask.sum()
        safe_num_tokens = num_tokens.clamp(min=1)
        return mtp_loss_scale * mtp_loss / safe_num_tokens

    def fixed_upstream(loss_mask, mtp_loss, mtp_loss_scale, total):  # the control: another normalisation
        return mtp_loss_scale * mtp_loss / total

    assert mtp_loss_is_rank_mean(dev_like) and not mtp_loss_is_rank_mean(fixed_upstream)
    assert not mtp_loss_is_rank_mean(len)  # no Python source: treated as fixed (nothing installed)


def test_an_fp8_folder_in_blocks_bridge_misreads_is_refused(tmp_path):
    """Megatron-Bridge 0.6.2 tiles FP8 scales 128 x 128 whatever weight_block_size says (pinned by
    test_production_path_on_cpu); the production path refuses such a folder before building."""
    import json

    from verl_ds4.verify.production import UnmappableFolder, check_block_size

    def folder(block):
        config = {"model_type": "deepseek_v4"} if block is None else {"quantization_config": {"weight_block_size": block}}
        (tmp_path / "config.json").write_text(json.dumps(config))
        return tmp_path

    with pytest.raises(UnmappableFolder, match=r"weight_block_size is \[8, 16\]"):
        check_block_size(folder([8, 16]))
    check_block_size(folder([128, 128]))  # the hub's blocks: accepted
    check_block_size(folder(None))  # a dequantised folder: accepted


def _unpack_in_child(args):
    """In a forked pool worker (its own copy of the module)."""
    root, commit, archive = args
    megatron_dev.UNPACK_ROOT = Path(root)
    return str(megatron_dev.unpack(commit, archive=Path(archive)).root)


def test_two_lanes_unpacking_one_archive_at_once_both_get_the_tree(tmp_path, monkeypatch):
    """The test lanes may unpack the same commit at the same moment: each extracts into a folder of its own and renames
    it into place; every caller gets the finished tree and no partial folder of theirs is left. A partial folder left by
    a killed unpack does not stand in the way (and is left alone); a broken archive fails and leaves nothing."""
    import multiprocessing
    import tarfile

    src = tmp_path / "src"
    (src / "megatron" / "core").mkdir(parents=True)
    for i in range(200):
        (src / "megatron" / "core" / f"m{i}.py").write_text("x = 1\n" * 50)
    archive = tmp_path / "export.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src / "megatron", arcname="megatron")
    root = tmp_path / "carry"
    commit = megatron_dev.DEFAULT_COMMIT
    stale = root / f"megatron_dev_{commit[:8]}.partial-killed"
    (stale / "megatron").mkdir(parents=True)
    with multiprocessing.get_context("fork").Pool(4) as pool:
        roots = pool.map(_unpack_in_child, [(str(root), commit, str(archive))] * 4)
    dest = root / f"megatron_dev_{commit[:8]}"
    assert set(roots) == {str(dest)} and (dest / "COMMIT").read_text().strip() == commit
    assert len(list((dest / "megatron" / "core").iterdir())) == 200
    left = sorted(p.name for p in root.iterdir())
    assert left == [dest.name, stale.name], left  # only the tree, and the killed unpack's folder it did not touch
    broken = tmp_path / "broken.tar.gz"
    broken.write_bytes(archive.read_bytes()[:200])
    other = root / "other"
    monkeypatch.setattr(megatron_dev, "UNPACK_ROOT", other)  # this process: restored after the test
    with pytest.raises(Exception):
        megatron_dev.unpack(commit, archive=broken)
    assert not other.exists() or list(other.iterdir()) == []  # the failed unpack's own folder is gone
