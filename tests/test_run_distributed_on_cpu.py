"""run_distributed's forked ranks survive a parent that used Megatron in-process (~25 s on 2 cores).

megatron-core 0.16.1's ``destroy_model_parallel`` leaves two process groups set in its parallel state
(``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`` and its gloo twin). A rank forked from such a parent that
initialises Megatron again drops the parent's last reference; ``ProcessGroupGloo``'s destructor then joins
the parent's gloo threads, which the child does not have, and the rank hangs in silence. In a full test
run this hung tests/test_thd_differential_on_cpu.py (after tests/test_model_device_on_cpu.py had used
Megatron in the pytest process) for 600 s per test. ``keep_inherited_groups`` holds those groups in the
child; the negative control turns it off and shows the hang.
"""

from __future__ import annotations

import pytest

from verl_ds4.mcore import distributed as rd


@pytest.fixture(scope="module")
def megatron_used_in_process():
    """This process: Megatron's parallel state initialised and destroyed on a one-rank gloo group."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.distributed import ProcessGroup

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{rd.free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    left = [name for name, value in vars(parallel_state).items() if isinstance(value, ProcessGroup)]
    assert left, "Megatron no longer leaves groups behind: this test's premise is gone (simplify keep_inherited_groups)"
    return left


def _init_megatron(rank: int, world_size: int) -> int:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    parallel_state.destroy_model_parallel()
    return rank


def test_forked_ranks_initialise_megatron_after_the_parent_did(megatron_used_in_process):
    assert rd.run_distributed(_init_megatron, world_size=2, timeout=120) == [0, 1]


def test_negative_control_without_holding_the_groups_the_ranks_hang(megatron_used_in_process, monkeypatch):
    monkeypatch.setattr(rd, "keep_inherited_groups", lambda: 0)  # the forked ranks inherit the patch
    with pytest.raises(rd.DistributedRunError, match="2 of 2 ranks did not finish within 15 s"):
        rd.run_distributed(_init_megatron, world_size=2, timeout=15)


def _rank(rank: int, world_size: int) -> int:
    return rank


def test_nccl_ranks_are_refused_a_fork_before_any_process_starts(monkeypatch):
    started = []
    monkeypatch.setattr(rd.mp, "get_context", lambda method: started.append(method))  # nothing may start
    with pytest.raises(ValueError, match=r"backend='nccl' with start_method='fork'.*Expected start_method='spawn'"):
        rd.run_distributed(_rank, world_size=1, backend="nccl", start_method="fork")
    assert started == []
    # control: the check reads the pair, so nccl with spawn gets past it (up to the context, stubbed out here)
    with pytest.raises(AttributeError):  # the stub returns None: .Queue fails after the check passed
        rd.run_distributed(_rank, world_size=1, backend="nccl", start_method="spawn")
    assert started == ["spawn"]
    monkeypatch.undo()
    assert rd.run_distributed(_rank, world_size=1, backend="gloo", start_method="fork", timeout=60) == [0]  # gloo forks
