"""The SGLang emitter's send_adapter and retire_adapter against the scripted client of
scripted_sglang.py (no HTTP): an adapter before our base is weights lost, the load request (config,
flattened bucket, checksums unless verification is off) and its ack with phase times, an adapter the
server cannot hold, a stale copy unloaded and loaded again, a refused load, a load that does not list the
adapter, and each retirement outcome. Values are written out by hand.
"""

from __future__ import annotations

import itertools
import logging

import pytest
from scripted_sglang import BASE, OK, URL, Client, adapter, emitter, own

from titan_lora.clients import sglang
from titan_lora.clients.sglang_api import ControlResult, SGLangTimeout
from titan_lora.transfer.errors import EngineWeightsLost, TransferError

# ---- send_adapter and retire_adapter -----------------------------------------------------------------


def test_an_adapter_before_our_base_is_weights_lost() -> None:
    client = Client()
    with pytest.raises(EngineWeightsLost) as err:
        emitter(client).send_adapter(adapter())
    assert str(err.value) == (f"SGLang at {URL} serves weight_version 'launch-version', not the base this trainer "
                              "sent (None): send the base first")
    em = emitter(client)
    em.send_base(BASE, 1)
    client.served = "launch-version"  # restarted
    with pytest.raises(EngineWeightsLost):
        em.send_adapter(adapter())


def test_the_adapter_request_and_its_ack(monkeypatch: pytest.MonkeyPatch) -> None:
    client = Client()
    em = emitter(client)
    em.send_base(BASE, 1)
    client.calls.clear()
    serialized: list[tuple] = []
    real = sglang.serialize_for_ranks
    monkeypatch.setattr(sglang, "serialize_for_ranks",
                        lambda obj, tp, cuda: serialized.append((tp, cuda)) or real(obj, tp, cuda))
    clock = itertools.count(100)
    monkeypatch.setattr(sglang.time, "perf_counter", lambda: float(next(clock)))
    payload = adapter()
    ack = em.send_adapter(payload)
    assert client.names() == ["weight_version", "load"], "the limits read with the base are reused"
    req = client.calls[1][1]
    assert req.lora_name == "policy-v1" and req.load_format == "flattened_bucket"
    assert req.config_dict == {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
                               "peft_type": "LORA"}
    assert serialized == [(2, False)] and len(req.serialized_named_tensors) == 2
    assert set(req.expected_checksums) == set(payload.tensors)
    assert (ack.version, ack.num_tensors, ack.nbytes) == (1, 4, payload.nbytes)
    assert ack.phases_ms == {"pack_ms": 1e3, "serialize_ms": 1e3, "transfer_apply_ms": 1e3}


def test_without_verification_no_checksums_are_sent() -> None:
    client = Client()
    em = emitter(client, verify_checksums=False)
    em.send_base(BASE, 1)
    em.send_adapter(adapter())
    assert client.calls[-1][1].expected_checksums is None


def test_an_adapter_the_server_cannot_hold_is_refused_naming_the_server() -> None:
    client = Client()
    em = emitter(client)
    em.send_base(BASE, 1)
    with pytest.raises(TransferError, match=f"^SGLang at {URL} serves LoRA rank <= 16, the adapter has rank 32"):
        em.send_adapter(adapter(r=32))


def test_a_stale_copy_is_unloaded_and_the_adapter_loaded_again(caplog: pytest.LogCaptureFixture) -> None:
    client = Client()
    em = emitter(client)
    em.send_base(BASE, 1)
    client.calls.clear()
    client.load = [ControlResult(False, "adapter unit-v1 is already loaded")]
    with caplog.at_level(logging.WARNING, logger="titan_lora.clients.sglang"):
        em.send_adapter(adapter("unit-v1"))
    assert client.names() == ["weight_version", "load", "unload", "load"]
    assert client.calls[2] == ("unload", "unit-v1", 42.0)
    assert own(caplog, "unit-v1") == ["SGLang holds unit-v1 (adapter unit-v1 is already loaded); unloading it "
                                      "and loading again"]


def test_a_refused_load_is_an_error_and_nothing_is_unloaded() -> None:
    client = Client()
    em = emitter(client)
    em.send_base(BASE, 1)
    client.load = [ControlResult(False, "out of memory")]
    with pytest.raises(TransferError) as err:
        em.send_adapter(adapter())
    assert str(err.value) == "SGLang refused adapter policy-v1: out of memory"
    assert "unload" not in client.names()


def test_a_load_that_does_not_list_the_adapter_is_an_error() -> None:
    client = Client()
    em = emitter(client)
    em.send_base(BASE, 1)
    client.load = [ControlResult(True, "ok", {"policy-v0": "x"})]
    with pytest.raises(TransferError) as err:
        em.send_adapter(adapter())
    assert str(err.value) == ("SGLang acknowledged adapter policy-v1 but does not list it as loaded (loaded: "
                              "['policy-v0'])")


def test_retirement_outcomes(caplog: pytest.LogCaptureFixture) -> None:
    client = Client()
    em = emitter(client)
    client.unload = [OK, ControlResult(False, "lora unit-v3 does not exist"),
                     ControlResult(False, "in use by 2 requests"), SGLangTimeout("timed out")]
    with caplog.at_level(logging.WARNING, logger="titan_lora.clients.sglang"):
        assert em.retire_adapter("unit-v2", 5.0) is True
        assert em.retire_adapter("unit-v3", 5.0) is True, "already gone counts as retired"
        assert em.retire_adapter("unit-v4", 5.0) is False
        assert em.retire_adapter("unit-v5", 2.5) is False
    assert client.calls == [("unload", "unit-v2", 5.0), ("unload", "unit-v3", 5.0),
                            ("unload", "unit-v4", 5.0), ("unload", "unit-v5", 2.5)]
    assert own(caplog, "unit-v") == [
        "SGLang refused to unload unit-v4: in use by 2 requests",
        f"unloading unit-v5 on {URL} took over 2.5s; the server keeps working on it",
    ]
