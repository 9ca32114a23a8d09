"""share and on_rank0 in one process (no process group): the value passes through, `then` always runs,
and a failure of rank 0's work comes back as RankZeroError naming the error, with the error attached; on
2 gloo ranks, `share_value` brings rank 0's value to both in the outcome's one broadcast."""

from __future__ import annotations

import pickle

import pytest
from dist_helpers import run_ranks

from titan_lora.sync.collective import RankZeroError, on_rank0, share
from titan_lora.transfer.errors import TransferError


def test_share_without_a_process_group_is_the_value_itself() -> None:
    value = {"a": [1, 2]}
    assert share(value) is value and share(None) is None


def test_on_rank0_returns_the_value_and_runs_then() -> None:
    ran: list[str] = []
    assert on_rank0(lambda: 41 + 1, lambda: ran.append("then")) == 42 and ran == ["then"]
    assert on_rank0(lambda: "x") == "x"


def test_on_other_ranks_nothing_runs_but_then() -> None:
    ran: list[str] = []
    assert on_rank0(None, lambda: ran.append("then")) is None and ran == ["then"]


def test_a_failure_raises_rank_zero_error_after_then_with_its_cause() -> None:
    ran: list[str] = []
    cause = ValueError("bad bucket")

    def fail() -> None:
        raise cause

    with pytest.raises(RankZeroError) as err:
        on_rank0(fail, lambda: ran.append("then"))
    assert str(err.value) == "ValueError: bad bucket" and err.value.cause is cause and ran == ["then"]
    assert isinstance(err.value, TransferError)


def test_rank_zero_error_defaults_to_no_cause() -> None:
    err = RankZeroError("TransferError: x")
    assert err.cause is None and str(err) == "TransferError: x"


def test_an_interrupt_is_not_turned_into_an_error() -> None:
    def interrupted() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        on_rank0(interrupted)


def test_share_without_a_group_of_several_sends_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from titan_lora.sync import collective

    monkeypatch.setattr(collective.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(collective.dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(collective.dist, "broadcast", lambda *a, **k: pytest.fail("a group of one broadcast"))
    assert share("mine") == "mine"


def _shares(rank: int, world: int) -> None:
    import torch.distributed as dist

    from titan_lora.sync import collective

    broadcasts, object_lists = [], []
    real_broadcast, real_object_list = dist.broadcast, dist.broadcast_object_list
    dist.broadcast = lambda *a, **k: broadcasts.append(1) or real_broadcast(*a, **k)
    dist.broadcast_object_list = lambda *a, **k: object_lists.append(1) or real_object_list(*a, **k)
    try:
        small = {"tensors": 448, "version": rank + 7, "phases": {"transfer_ms": 0.5}}
        assert share(small) == {"tensors": 448, "version": 7, "phases": {"transfer_ms": 0.5}}
        assert (broadcasts, object_lists) == ([1], []), "a control message is one broadcast"
        room = collective.SHARE_BOX_BYTES - 8  # the box less its length field
        edge = "x" * next(n for n in range(room, 0, -1) if len(pickle.dumps("x" * n)) == room)  # fills it
        assert share(edge if rank == 0 else None) == edge
        big = list(range(rank, rank + 5000))  # over the box: follows by broadcast_object_list
        assert share(big) == list(range(5000))
        assert (len(broadcasts), len(object_lists)) == (3, 1)
        assert share(None) is None and share(rank) == 0
    finally:
        dist.broadcast, dist.broadcast_object_list = real_broadcast, real_object_list


@pytest.mark.parametrize("world", [2, 3])
def test_share_brings_rank_0s_value_in_one_broadcast_and_a_large_one_after(world: int) -> None:
    run_ranks(world, _shares)


def _shared_value(rank: int, world: int) -> None:
    calls = []
    work = (lambda: calls.append(rank) or {"needs_base": True}) if rank == 0 else None
    got = on_rank0(work, share_value=True)
    assert got == {"needs_base": True}, f"rank {rank} got {got}"
    assert calls == ([0] if rank == 0 else []), "only rank 0 runs fn"
    plain = on_rank0((lambda: 7) if rank == 0 else None)
    assert plain == (7 if rank == 0 else None), "without share_value the value stays on rank 0"

    def fail() -> None:
        raise ValueError("the engine said no")

    with pytest.raises(RankZeroError, match="ValueError: the engine said no"):
        on_rank0(fail if rank == 0 else None, share_value=True)


def test_share_value_brings_rank_0s_value_to_every_rank_with_its_outcome() -> None:
    """One broadcast carries both: the syncer's base check costs one control message a sync, not two."""
    run_ranks(2, _shared_value)
