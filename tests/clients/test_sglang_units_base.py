"""The SGLang emitter's send_base against the scripted client of scripted_sglang.py (no HTTP): one
weight-update session whose last bucket flips weight_version and flushes, a token per emitter, the call
order and flags per pause mode (abort, retract, in_place with its bounded flush), a session left open,
a session that cannot open or close, a refused bucket, an empty base and a version that did not flip,
and the base's phase time. Values are written out by hand.
"""

from __future__ import annotations

import itertools
import logging

import pytest
from scripted_sglang import BASE, OK, URL, Client, emitter, own

from titan_lora.clients import sglang
from titan_lora.clients.sglang_api import ControlResult
from titan_lora.transfer.errors import TransferError

# ---- send_base ---------------------------------------------------------------------------------------


def test_the_base_is_one_session_whose_last_bucket_flips_the_version_and_flushes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    client = Client()
    em = emitter(client, bucket_bytes=32)  # the 32-byte embedding, then the norm: two buckets
    serialized: list[tuple] = []
    real = sglang.serialize_for_ranks
    monkeypatch.setattr(sglang, "serialize_for_ranks",
                        lambda obj, tp, cuda: serialized.append((tp, cuda)) or real(obj, tp, cuda))
    ack = em.send_base(BASE, version=5)
    assert serialized == [(2, False), (2, False)]
    assert client.names() == ["server_info", "begin", "update", "update", "end", "weight_version"]
    first, last = client.calls[2][1], client.calls[3][1]
    token = client.served
    assert token.startswith("titan-lora-") and token.endswith("-base-v5") and len(token) == len("titan-lora--base-v5") + 12
    assert (first.weight_version, first.flush_cache, last.weight_version, last.flush_cache) == (None, False, token, True)
    assert first.load_format == last.load_format == "flattened_bucket" and len(first.serialized_named_tensors) == 2
    assert (ack.version, ack.num_tensors, ack.nbytes) == (5, 2, 48) and set(ack.phases_ms) == {"base_ms"}
    assert em.engine_incarnation() == token and em._installed == token


def test_each_emitter_marks_its_own_base(monkeypatch: pytest.MonkeyPatch) -> None:
    one, two = Client(), Client()
    emitter(one).send_base(BASE, 1)
    emitter(two).send_base(BASE, 1)
    assert one.served != two.served


@pytest.mark.parametrize("mode", ["abort", "retract"])
def test_a_pausing_base_update_pauses_then_continues(mode: str) -> None:
    client = Client()
    emitter(client, pause_mode=mode).send_base(BASE, 1)
    assert client.names() == ["server_info", "pause", "begin", "update", "end", "continue", "weight_version"]
    assert client.calls[1] == ("pause", mode) and client.calls[3][1].flush_cache is True


def test_an_in_place_update_keeps_requests_and_flushes_after_they_drain(caplog: pytest.LogCaptureFixture) -> None:
    client = Client()
    emitter(client, pause_mode="in_place").send_base(BASE, 1)
    assert client.names() == ["server_info", "pause", "begin", "update", "end", "continue", "flush",
                              "weight_version"]
    assert client.calls[3][1].flush_cache is False and client.calls[6] == ("flush", 42.0)
    client = Client()
    client.flushed = False
    with caplog.at_level(logging.WARNING, logger="titan_lora.clients.sglang"):
        emitter(client, pause_mode="in_place").send_base(BASE, 1)
    assert own(caplog, "prefix cache") == ["SGLang kept its prefix cache after the base update (requests never drained); "
                               "cached prefixes computed with the old base may be reused"]


def test_a_flushed_in_place_update_warns_nothing_and_the_base_time_is_milliseconds(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = itertools.count(100)
    monkeypatch.setattr(sglang.time, "perf_counter", lambda: float(next(clock)))
    with caplog.at_level(logging.WARNING, logger="titan_lora.clients.sglang"):
        ack = emitter(Client(), pause_mode="in_place").send_base(BASE, 1)
    assert own(caplog, "prefix cache") == []
    assert ack.phases_ms == {"base_ms": 1e3}, "read at 100 and 101"


def test_a_session_left_open_is_closed_and_reopened(caplog: pytest.LogCaptureFixture) -> None:
    client = Client()
    client.begin = [ControlResult(False, "a weight update is already open"), OK]
    with caplog.at_level(logging.WARNING, logger="titan_lora.clients.sglang"):
        emitter(client).send_base(BASE, 1)
    assert client.names()[:4] == ["server_info", "begin", "end", "begin"]
    assert own(caplog, URL) == [f"closing a weight-update session left open on {URL}"]


def test_a_session_that_cannot_open_is_an_error() -> None:
    client = Client()
    client.begin = [ControlResult(False, "busy")]
    with pytest.raises(TransferError) as err:
        emitter(client).send_base(BASE, 1)
    assert str(err.value) == "SGLang could not open a weight-update session: busy"
    assert client.names() == ["server_info", "begin"]


def test_a_refused_bucket_still_closes_the_session() -> None:
    client = Client()
    client.update = [ControlResult(False, "shape mismatch")]
    with pytest.raises(TransferError) as err:
        emitter(client, bucket_bytes=32).send_base(BASE, 3)
    assert str(err.value) == "SGLang refused base bucket 1 of version 3: shape mismatch"
    assert client.names() == ["server_info", "begin", "update", "end"]


def test_a_session_that_does_not_close_is_an_error() -> None:
    client = Client()
    client.end = ControlResult(False, "still loading")
    with pytest.raises(TransferError) as err:
        emitter(client).send_base(BASE, 4)
    assert str(err.value) == "SGLang could not close the weight update of version 4: still loading"


def test_an_empty_base_and_a_version_that_did_not_flip_are_errors() -> None:
    with pytest.raises(TransferError) as err:
        emitter(Client()).send_base({}, 2)
    assert str(err.value) == "send_base of version 2 got no tensors"

    class Stuck(Client):
        def update_weights_from_tensor(self, req) -> ControlResult:
            self.calls.append(("update", req))
            return OK  # acknowledged, but the served version does not change

    client = Stuck()
    em = emitter(client)
    with pytest.raises(TransferError) as err:
        em.send_base(BASE, 2)
    assert str(err.value) == (f"SGLang acknowledged base version 2 but serves weight_version 'launch-version', not "
                              f"'titan-lora-{em._token}-base-v2': the update did not take effect")
    assert em._installed is None
