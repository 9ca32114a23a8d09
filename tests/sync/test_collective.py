"""share and on_rank0 in one process (no process group): the value passes through, `then` always runs,
and a failure of rank 0's work comes back as RankZeroError naming the error, with the error attached; on
2 gloo ranks, `share_value` brings rank 0's value to both in the outcome's one broadcast."""

from __future__ import annotations

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


@pytest.mark.parametrize("world, broadcasts", [(1, 0), (2, 1), (3, 1)])
def test_share_broadcasts_rank_0s_value_only_in_a_group_of_several(monkeypatch: pytest.MonkeyPatch, world: int,
                                                                    broadcasts: int) -> None:
    from titan_lora.sync import collective

    calls: list[tuple] = []

    def broadcast_object_list(box: list, src: int) -> None:
        calls.append((list(box), src))
        box[0] = "rank 0's value"

    monkeypatch.setattr(collective.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(collective.dist, "get_world_size", lambda: world)
    monkeypatch.setattr(collective.dist, "broadcast_object_list", broadcast_object_list)
    got = share("mine")
    assert got == ("rank 0's value" if broadcasts else "mine")
    assert calls == [(["mine"], 0)] * broadcasts


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
