"""SGLang behaviours the README promises, each against the conformance server (or a misbehaving stand-in).

Every test is named after the behaviour it checks. Where the conformance server must misbehave (a load
it acknowledges but does not list, a failing bucket), the test wraps that one engine method on the
instance; the server module itself is untouched.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time

import pytest
from scripted_sglang import Answering, serving
from sglang_conformance import ConformanceServer
from test_sglang import (
    GREEDY,
    LOAD,
    PROMPT,
    SERVER,
    TINY,
    UPDATE,
    Driver,
    Trainer,
    assert_parity,
    calls,
    emitter_at_v1,
    emitter_for,
    policy_versions,
)

from titan_lora.clients.sglang import SGLangEmitter
from titan_lora.clients.sglang_api import SGLangAuthError, SGLangClient, SGLangError, SGLangTimeout
from titan_lora.clients.sglang_checks import served_modules, sglang_adapter_config
from titan_lora.transfer.errors import EngineWeightsLost, TransferError

# ---------------------------------------------------------------- the loaded-adapters check


@pytest.mark.parametrize("listed", [lambda name: {}, lambda name: None], ids=["other-names", "no-field"])
def test_a_load_acked_but_not_listed_as_loaded_is_an_error_and_not_published(listed) -> None:
    trainer = Trainer()
    with ConformanceServer(TINY, **SERVER) as srv:
        emitter, versions = emitter_for(srv), policy_versions()
        driver = Driver(emitter, versions)
        driver.sync(trainer, 1)
        real = srv.engine.load_adapter

        def lying_load(body: dict) -> dict:
            out = real(body)  # loads it, then answers success without listing it
            return {**out, "loaded_adapters": listed(body["lora_name"])}

        srv.engine.load_adapter = lying_load
        with pytest.raises(TransferError, match="does not list it as loaded"):
            driver.sync(trainer, 2)
        assert versions.live == [1] and versions.active.name == "policy-v1"


# ---------------------------------------------------------------- multi-bucket base: flush, version placement


def _bucketed(srv: ConformanceServer, bucket_bytes: int) -> tuple[SGLangEmitter, list[set[str]]]:
    emitter = SGLangEmitter(SGLangClient(srv.url, timeout_s=10.0, retries=1), keep_versions=2,
                            bucket_bytes=bucket_bytes)
    received: list[set[str]] = []
    decode = srv.engine._decode

    def recording_decode(body: dict) -> dict:
        tensors = decode(body)
        if "lora_name" not in body:
            received.append(set(tensors))
        return tensors

    srv.engine._decode = recording_decode
    return emitter, received


def test_a_multi_bucket_base_flushes_and_sets_the_version_only_with_its_last_bucket() -> None:
    trainer = Trainer()
    with ConformanceServer(TINY, **SERVER) as srv:
        emitter, received = _bucketed(srv, bucket_bytes=40_000)
        driver = Driver(emitter, policy_versions())
        driver.sync(trainer, 7)
        updates = [b for p, b in srv.engine.calls if p == UPDATE]
        assert len(updates) >= 3, "the test needs several buckets"
        assert [u["flush_cache"] for u in updates] == [False] * (len(updates) - 1) + [True]
        assert [u.get("weight_version") for u in updates[:-1]] == [None] * (len(updates) - 1)
        served = emitter.client.weight_version()
        assert updates[-1]["weight_version"] == served and served.endswith("-base-v7")
        # Every base tensor arrived exactly once, and the served model is the trainer's.
        assert sum(len(r) for r in received) == len(set().union(*received)) == len(trainer.base)
        assert set().union(*received) == set(trainer.base)
        assert_parity(emitter.client, trainer, "policy-v7")


def test_a_failed_bucket_closes_the_session_and_leaves_the_served_version() -> None:
    trainer = Trainer()
    with ConformanceServer(TINY, **SERVER) as srv:
        emitter, _ = _bucketed(srv, bucket_bytes=40_000)
        real, seen = srv.engine.update_base, []

        def second_fails(body: dict) -> dict:
            seen.append(1)
            return {"success": False, "message": "disk on fire"} if len(seen) == 2 else real(body)

        srv.engine.update_base = second_fails
        with pytest.raises(TransferError, match=r"refused base bucket 2 of version 3: disk on fire"):
            Driver(emitter, policy_versions()).sync(trainer, 3)
        assert len(seen) == 2, "no bucket is sent after a refused one"
        assert calls(srv)[-1] == "/end_weight_update" and not srv.engine.session_open
        assert emitter.client.weight_version() == "default"
        with pytest.raises(EngineWeightsLost):
            emitter.send_adapter(trainer.step(3))


# ---------------------------------------------------------------- stale-session recovery


def test_a_weight_update_session_left_open_is_closed_and_reopened(caplog) -> None:
    trainer = Trainer()
    with ConformanceServer(TINY, **SERVER) as srv:
        emitter = emitter_for(srv)
        assert emitter.client.begin_weight_update().success  # a trainer died inside its update
        with caplog.at_level(logging.WARNING, logger="titan_lora.clients.sglang"):
            Driver(emitter, policy_versions()).sync(trainer, 1)
        session = calls(srv, "/begin_weight_update", "/end_weight_update", UPDATE)
        assert session == ["/begin_weight_update", "/begin_weight_update", "/end_weight_update",
                           "/begin_weight_update", UPDATE, "/end_weight_update"]
        assert "left open" in caplog.text and not srv.engine.session_open
        assert_parity(emitter.client, trainer, "policy-v1")


# ---------------------------------------------------------------- unsupported PEFT options


@pytest.mark.parametrize("option, value", [
    ("rank_pattern", {"q_proj": 8}), ("alpha_pattern", {"q_proj": 2.0}), ("modules_to_save", ["lm_head"]),
    ("use_dora", True), ("bias", "all"),
])
def test_peft_options_sglang_ignores_are_refused_before_sending(option: str, value: object) -> None:
    trainer = Trainer()
    with ConformanceServer(TINY, **SERVER) as srv:
        emitter = emitter_at_v1(srv, trainer)
        payload = trainer.step(2)
        payload = dataclasses.replace(payload, peft_config={**payload.peft_config, option: value})
        with pytest.raises(TransferError, match=f"{option}.*SGLang 0.5.23 ignores or refuses"):
            emitter.send_adapter(payload)
        assert len(calls(srv, LOAD)) == 1, "only version 1 was ever sent"


def test_adapter_config_folds_rslora_into_alpha_and_needs_the_core_keys() -> None:
    cfg = sglang_adapter_config({"r": 4, "lora_alpha": 8, "use_rslora": True, "target_modules": {"v", "q"}})
    # alpha / sqrt(r) = 4 must equal alpha' / r: alpha' = 8 * sqrt(4) = 16.
    assert cfg == {"r": 4, "lora_alpha": 16.0, "use_rslora": False, "target_modules": ["q", "v"],
                   "peft_type": "LORA"}
    assert sglang_adapter_config({"r": 4, "lora_alpha": 8, "target_modules": ["q"]})["lora_alpha"] == 8
    with pytest.raises(TransferError, match=r"lacks \['lora_alpha'\]"):
        sglang_adapter_config({"r": 4, "target_modules": ["q"]})


# ---------------------------------------------------------------- fused-target expansion


def test_served_modules_expand_sglangs_fused_groups() -> None:
    assert served_modules(frozenset({"q_proj"})) == {"q_proj", "k_proj", "v_proj", "qkv_proj"}
    assert served_modules(frozenset({"gate_up_proj", "o_proj"})) == {"gate_proj", "up_proj", "gate_up_proj",
                                                                     "o_proj"}
    assert served_modules(frozenset({"down_proj"})) == {"down_proj"}
    assert served_modules(frozenset({"all"})) is None and served_modules(None) is None


@pytest.mark.parametrize("server_targets", [["q_proj", "down_proj"], ["qkv_proj", "down_proj"]])
def test_a_server_adapting_one_fused_member_takes_the_whole_group(server_targets: list[str]) -> None:
    trainer = Trainer()  # adapts q_proj, v_proj, down_proj: v_proj rides on the q/k/v group
    with ConformanceServer(TINY, **{**SERVER, "lora_target_modules": server_targets}) as srv:
        emitter = emitter_for(srv)
        Driver(emitter, policy_versions()).sync(trainer, 1)
        assert_parity(emitter.client, trainer, "policy-v1")


def test_a_module_outside_every_served_group_is_refused_naming_the_flag() -> None:
    trainer = Trainer()
    with ConformanceServer(TINY, **{**SERVER, "lora_target_modules": ["qkv_proj", "gate_up_proj"]}) as srv:
        with pytest.raises(TransferError, match=r"does not adapt \['down_proj'\].*--lora-target-modules"):
            Driver(emitter_for(srv), policy_versions()).sync(trainer, 1)
        assert calls(srv, LOAD) == []


# ---------------------------------------------------------------- the dp_size check


def test_a_data_parallel_server_is_refused_naming_dp_size() -> None:
    with ConformanceServer(TINY, **{**SERVER, "dp_size": 2}) as srv:
        emitter = emitter_for(srv)
        with pytest.raises(TransferError, match=r"dp_size=2.*--dp-size 1"):
            emitter.engine_limits()
        with pytest.raises(TransferError, match="--dp-size 1"):
            Driver(emitter, policy_versions()).sync(Trainer(), 1)
        assert calls(srv, UPDATE, LOAD) == []


# ---------------------------------------------------------------- 403 and timeout errors


class _Forbidden(Answering):
    """An SGLang whose weight endpoints need the --admin-api-key the client lacks."""

    status = 403

    def answer(self, body: bytes) -> object:
        return {"error": "Forbidden"}


def test_403_names_the_admin_api_key() -> None:
    with serving(_Forbidden) as url:
        client = SGLangClient(url, api_key="user-key", retries=0)
        with pytest.raises(SGLangAuthError, match=r"forbids /server_info \(403\).*--admin-api-key"):
            client.server_info()
        with pytest.raises(SGLangAuthError, match="403"):
            client.unload_lora_adapter("policy-v1", timeout_s=1.0)


def test_a_request_past_its_deadline_raises_a_timeout_naming_the_key_and_is_not_retried() -> None:
    trainer = Trainer()
    with ConformanceServer(TINY, gen_delays_s=(0.0, 2.0), **SERVER) as srv:
        emitter = emitter_for(srv, retries=2)
        Driver(emitter, policy_versions()).sync(trainer, 1)
        emitter.client.generate(PROMPT, "policy-v1", GREEDY)  # the fast one
        t0 = time.monotonic()
        with pytest.raises(SGLangTimeout, match=r"did not answer /generate within 0\.3s.*timeout_s"):
            emitter.client.generate(PROMPT, "policy-v1", GREEDY, timeout_s=0.3)
        assert time.monotonic() - t0 < 1.5, "the deadline bounds the call"
        assert len(calls(srv, "/generate")) == 2, "a timed-out request is not sent again"


# ---------------------------------------------------------------- the retry rules


class _Hangup:
    """A TCP server that accepts, reads the request, and closes without answering; counts connections."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.settimeout(1.0)
            try:
                conn.recv(65536)
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def hangup():
    server = _Hangup()
    yield server
    server.close()


def test_a_broken_connection_is_retried_only_for_idempotent_reads(hangup: _Hangup) -> None:
    client = SGLangClient(hangup.url, timeout_s=5.0, retries=2)
    with pytest.raises(SGLangError, match="broke during /server_info"):
        client.server_info()
    assert hangup.connections == 3, "a read is retried `retries` times"
    hangup.connections = 0
    with pytest.raises(SGLangError, match="broke during /begin_weight_update"):
        client.begin_weight_update()
    assert hangup.connections == 1, "a state-changing call is never repeated once delivered"
    hangup.connections = 0
    with pytest.raises(SGLangError, match="broke during /unload_lora_adapter"):
        client.unload_lora_adapter("policy-v1", timeout_s=5.0)
    assert hangup.connections == 1


def test_an_undelivered_request_is_retried_then_names_the_fix() -> None:
    with socket.socket() as s:  # a port with nothing listening: every connect is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = SGLangClient(f"http://127.0.0.1:{port}", timeout_s=5.0, retries=2)
    with pytest.raises(SGLangError, match=r"after 3 attempt\(s\).*\[engine\] url"):
        client.begin_weight_update()  # nothing was sent, so even a state-changing call may be retried
    with pytest.raises(SGLangError, match=r"after 1 attempt\(s\)"):
        client.unload_lora_adapter("policy-v1", timeout_s=5.0)  # unloads are never retried
