"""The ledger: each model's calls run in seq_id order, a resent call runs once, a key sees only its own."""

from __future__ import annotations

import time

import pytest

from titan_lora.service.ledger import RESEND_WINDOW, Ledger, Op, RequestError
from titan_lora.service.slots import SlotSpec


def _ledger_with_model() -> Ledger:
    ledger = Ledger(slots=2)
    ledger.create("tml-a", "s", "s:train:0", SlotSpec(rank=4), "create-0")
    assert [op.kind for op in ledger.take(0)] == ["create"]
    ledger.created("s:train:0")
    return ledger


def test_calls_run_in_seq_id_order_whatever_order_they_arrive_in() -> None:
    ledger = _ledger_with_model()
    for seq in (3, 2):  # chunks are sent first-chunk-last; optim_step may come before its forward_backward
        ledger.submit("s:train:0", seq, Op("optim_step", "s:train:0", f"r{seq}"))
    assert ledger.take(0) == []  # seq 1 has not arrived
    ledger.submit("s:train:0", 1, Op("forward_backward", "s:train:0", "r1"))
    assert [op.request_id for op in ledger.take(0)] == ["r1"]
    assert [op.request_id for op in ledger.take(0)] == ["r2"]
    assert [op.request_id for op in ledger.take(0)] == ["r3"]


def test_a_resent_seq_id_gets_the_first_request_id_and_runs_once() -> None:
    ledger = _ledger_with_model()
    assert ledger.submit("s:train:0", 1, Op("optim_step", "s:train:0", "first")) == "first"
    assert ledger.submit("s:train:0", 1, Op("optim_step", "s:train:0", "again")) == "first"
    assert [op.request_id for op in ledger.take(0)] == ["first"]
    assert ledger.take(0) == []


def test_another_keys_model_is_unknown_and_slots_run_out() -> None:
    ledger = _ledger_with_model()
    with pytest.raises(RequestError, match="not one of this API key's models") as err:
        ledger.model("s:train:0", "tml-b")
    assert err.value.status == 404
    ledger.create("tml-b", "t", "t:train:0", SlotSpec(rank=4), "create-1")
    with pytest.raises(RequestError, match="every adapter slot is taken") as err:
        ledger.create("tml-b", "t", "t:train:1", SlotSpec(rank=4), "create-2")
    ledger.forget("t:train:0")
    ledger.create("tml-b", "t", "t:train:1", SlotSpec(rank=4), "create-2")


def test_a_silent_session_ends_and_its_models_are_released() -> None:
    ledger = Ledger(slots=2, session_timeout_s=0.05)
    session = ledger.new_session("tml-a")
    ledger.create("tml-a", session, f"{session}:train:0", SlotSpec(rank=4), "c")
    ledger.take(0)
    ledger.created(f"{session}:train:0")
    ledger.submit(f"{session}:train:0", 2, Op("optim_step", f"{session}:train:0", "waiting"))
    time.sleep(0.1)
    (release,) = ledger.take(0)
    assert (release.kind, release.model_id) == ("release", f"{session}:train:0")
    with pytest.raises(RequestError, match="not one of this API key's models"):
        ledger.model(f"{session}:train:0", "tml-a")
    assert [op.request_id for op in ledger.forget(f"{session}:train:0")] == ["waiting"]
    with pytest.raises(RequestError, match="not a live session"):
        ledger.own_session(session, "tml-a")


def test_request_ids_are_kept_for_the_resend_window_only() -> None:
    ledger = _ledger_with_model()
    for seq in range(1, RESEND_WINDOW + 11):
        ledger.submit("s:train:0", seq, Op("optim_step", "s:train:0", f"r{seq}"))
        ledger.take(0)
    assert ledger.sent("s:train:0", RESEND_WINDOW + 10) == f"r{RESEND_WINDOW + 10}"
    assert ledger.sent("s:train:0", 10) is None
    assert len(ledger.models["s:train:0"].requests) <= RESEND_WINDOW


def test_a_reload_borrows_a_free_slot_until_given_back_and_waits_for_none() -> None:
    ledger = _ledger_with_model()  # slot 0 taken, slot 1 free
    ledger.borrow("reload-1", "tinker://m/sampler_weights/a", "tml-a")
    (op,) = ledger.take(0)
    assert (op.kind, op.request_id, op.args) == ("restore_sampler", "reload-1", ("tinker://m/sampler_weights/a",
                                                                                 "tml-a", 1))
    with pytest.raises(RequestError, match="every adapter slot is taken.*needs one for a moment"):
        ledger.borrow("reload-2", "tinker://m/sampler_weights/b", "tml-a")
    with pytest.raises(RequestError, match="every adapter slot is taken"):
        ledger.create("tml-a", "s", "s:train:1", SlotSpec(rank=4), "create-1")
    ledger.give_back(1)
    ledger.create("tml-a", "s", "s:train:1", SlotSpec(rank=4), "create-1")
    assert ledger.models["s:train:1"].slot == 1


def test_a_key_holds_at_most_its_share_of_the_slots() -> None:
    ledger = Ledger(slots=4, per_key=2)
    for i in range(2):
        ledger.create("tml-a", "s", f"s:train:{i}", SlotSpec(rank=4), f"c{i}")
    with pytest.raises(RequestError, match="this API key holds 2 training clients \\(\\[service\\] "
                                           "max_adapters_per_key = 2\\): close one's ServiceClient first"):
        ledger.create("tml-a", "s", "s:train:2", SlotSpec(rank=4), "c2")
    ledger.create("tml-b", "t", "t:train:0", SlotSpec(rank=4), "c3")  # another key still gets a slot
    ledger.forget("s:train:0")
    ledger.create("tml-a", "s", "s:train:2", SlotSpec(rank=4), "c4")
