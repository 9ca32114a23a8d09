"""WeightSyncer in one process, what it sends and how it checks it: the engine's limits and the base-stream
tally, the happy path (base once per engine incarnation, then the adapter; metrics and phase times),
the engine's acknowledgements, retries of the base and the adapter, a non-finite adapter that is never
sent, start-up (check_engine) and shutdown, and the messages when reaching the engine or sending keeps
failing. Runs against the fakes of inprocess_rig.py in milliseconds; the 2-rank tests in test_syncer.py
run the real receiver.
"""

from __future__ import annotations

import logging

import pytest
import torch
from inprocess_rig import ADAPTER_BYTES, BASE_BYTES, Base

from titan_lora.sync import syncer as syncer_mod
from titan_lora.sync.base_giving import BaseTally
from titan_lora.sync.syncer import EngineFailed, NonFiniteAdapterError, check_engine_limits
from titan_lora.transfer.errors import EngineWeightsLost, TransferError
from titan_lora.transfer.protocol import Ack, EngineLimits

# ---- check_engine_limits ---------------------------------------------------------------------------


def test_engine_limits_at_their_bounds_pass() -> None:
    check_engine_limits(EngineLimits(8, 3, frozenset({"q_proj", "v_proj"})), 8, ["q_proj", "v_proj"], 2)
    check_engine_limits(EngineLimits(8, 3, None), 8, ["anything"], 2)


def test_a_rank_above_the_engines_max_is_refused_naming_both_fixes() -> None:
    with pytest.raises(TransferError) as err:
        check_engine_limits(EngineLimits(8, 3, None), 16, ["q_proj"], 2)
    assert str(err.value) == ("[lora] rank = 16 exceeds the engine's max LoRA rank 8; restart the engine with "
                              "--max-lora-rank >= 16 or lower [lora] rank")


def test_targets_the_engine_cannot_adapt_are_named_sorted() -> None:
    with pytest.raises(TransferError) as err:
        check_engine_limits(EngineLimits(8, 3, frozenset({"v_proj", "q_proj"})), 8,
                            ["up_proj", "q_proj", "down_proj"], 2)
    assert str(err.value) == ("the engine cannot apply LoRA to ['down_proj', 'up_proj'] (it supports "
                              "['q_proj', 'v_proj']); narrow [lora] target_modules or restart the engine "
                              "with those modules enabled")


def test_too_few_adapter_slots_for_the_retention_window_are_refused() -> None:
    with pytest.raises(TransferError) as err:
        check_engine_limits(EngineLimits(8, 2, None), 8, ["q_proj"], 2)
    assert str(err.value) == ("[weight_sync] keep_versions = 2 needs 3 adapter slots but the engine has 2; "
                              "restart it with --max-loras >= 3")


def test_expert_adapters_are_refused_by_an_engine_that_serves_no_expert_lora_and_only_there() -> None:
    for says in (True, None):  # a GPU vLLM engine; the receiver, which holds bytes
        check_engine_limits(EngineLimits(8, 3, None, expert_lora=says), 8, ["q_proj"], 2, experts=True)
    check_engine_limits(EngineLimits(8, 3, None, expert_lora=False), 8, ["q_proj"], 2)  # attention only
    with pytest.raises(TransferError, match=r"serves no LoRA on them .* drop \"experts\" from \[lora\] target_modules"):
        check_engine_limits(EngineLimits(8, 3, None, expert_lora=False), 8, ["q_proj"], 2, experts=True)


def test_several_adapters_need_a_retention_window_each_and_the_refusal_says_so() -> None:
    check_engine_limits(EngineLimits(8, 9, None), 8, ["q_proj"], 2, adapters=3)
    with pytest.raises(TransferError) as err:
        check_engine_limits(EngineLimits(8, 8, None), 8, ["q_proj"], 2, adapters=3)
    assert str(err.value) == ("[weight_sync] keep_versions = 2 for each of 3 adapters needs 9 adapter slots but "
                              "the engine has 8; restart it with --max-loras >= 9 or train fewer [[adapters]]")


def test_the_tally_counts_what_passes_and_drain_runs_the_rest() -> None:
    base = Base()
    tally = BaseTally(base())
    assert iter(tally) is tally
    assert next(tally)[0] == "model.embed_tokens.weight"
    assert (tally.tensors, tally.nbytes, base.drawn) == (1, 24, 1)
    tally.drain()
    assert (tally.tensors, tally.nbytes, base.drawn) == (2, BASE_BYTES, 2)


# ---- the happy path ------------------------------------------------------------------------------


def test_a_new_syncer_holds_nothing_yet(rig) -> None:
    r = rig(lora_name="pol", keep_versions=3)
    s = r.syncer
    assert s.versions.lora_name == "pol" and s.versions.keep_versions == 3 and s.versions.live == []
    assert s.counters == {"base_sends": 0, "base_verified": 0, "syncs": 0, "engine_recoveries": 0,
                          "probe_failures": 0, "parity_gated": 0}
    assert s.last_metrics == {} and s.source is r.source and s.emitter is r.emitter
    assert s.device == torch.device("cpu") and s.base_weights is r.base and s.cfg.lora_name == "pol"


def test_first_sync_sends_the_base_then_the_adapter_and_publishes_it(rig) -> None:
    r = rig()
    metrics = dict(r.syncer.sync(1))
    assert r.emitter.calls == ["incarnation", "base v1", "incarnation", "adapter policy-v1"]
    assert (r.base.starts, r.base.drawn) == (1, 2)
    assert r.syncer.versions.active.name == "policy-v1" and r.syncer.versions.live == [1]
    assert r.syncer._current == 1
    timed = {k: metrics.pop(k) for k in ("sync/gather_ms", "sync/base_ms", "sync/total_ms")}
    assert metrics == {
        "sync/transfer_ms": 2.5, "sync/version": 1.0, "sync/bytes": float(ADAPTER_BYTES), "sync/tensors": 2.0,
        "sync/published": 1.0, "sync/live_versions": 1.0, "sync/retired": 0.0, "sync/retire_failed": 0.0,
        "sync/base_sends": 1.0, "sync/base_verified": 0.0, "sync/syncs": 1.0, "sync/engine_recoveries": 0.0,
        "sync/probe_failures": 0.0, "sync/parity_gated": 0.0,
    }
    assert all(isinstance(v, float) and v >= 0 for v in timed.values())
    assert r.syncer.last_metrics == {**metrics, **timed}


def test_the_base_goes_once_per_engine_incarnation(rig) -> None:
    r = rig()
    r.syncer.sync(1)
    r.emitter.calls.clear()
    metrics = r.syncer.sync(2)
    assert r.emitter.calls == ["incarnation", "adapter policy-v2"]
    assert "sync/base_ms" not in metrics and metrics["sync/base_sends"] == 1.0 and metrics["sync/syncs"] == 2.0
    assert metrics["sync/live_versions"] == 2.0 and r.syncer.versions.live == [1, 2]
    r.emitter.incarnation = "inc-2"  # the engine restarted between syncs: it holds no base of ours
    r.emitter.calls.clear()
    metrics = r.syncer.sync(3)
    assert r.emitter.calls == ["incarnation", "base v3", "incarnation", "adapter policy-v3"]
    assert metrics["sync/base_sends"] == 2.0 and "sync/base_ms" in metrics
    assert r.syncer.versions.live == [3], "a new incarnation holds none of the earlier versions"


def test_sync_timings_are_milliseconds_of_the_clock(rig, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter(range(100, 200))  # every reading advances one second
    monkeypatch.setattr(syncer_mod.time, "perf_counter", lambda: float(next(clock)))
    metrics = rig().syncer.sync(1)
    # sync: started=100, t0=101, gather ends 102; the base: started=103, done 104; the sync ends at 105.
    assert (metrics["sync/gather_ms"], metrics["sync/base_ms"], metrics["sync/total_ms"]) == (1e3, 1e3, 5e3)


def test_the_base_send_is_logged_with_its_size_and_time(rig, caplog, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter(range(100))
    monkeypatch.setattr(syncer_mod.time, "perf_counter", lambda: float(next(clock)) * 100.0)
    with caplog.at_level(logging.INFO, logger="titan_lora.sync.syncer"):
        rig().syncer.sync(1)
    assert "sent the base weights (2 tensors) in 100.0 s" in caplog.messages


# ---- what the engine acknowledges ------------------------------------------------------------------


@pytest.mark.parametrize("lie, said", [
    (lambda p: Ack(p.version, p.num_tensors, p.nbytes + 1), "version 1, 2 tensors, 65 bytes"),
    (lambda p: Ack(p.version, p.num_tensors - 1, p.nbytes), "version 1, 1 tensors, 64 bytes"),
    (lambda p: Ack(p.version + 1, p.num_tensors, p.nbytes), "version 2, 2 tensors, 64 bytes"),
])
def test_a_wrong_adapter_ack_raises_and_publishes_nothing(rig, lie, said: str) -> None:
    r = rig()
    r.emitter.adapter_ack = lie
    with pytest.raises(TransferError) as err:
        r.syncer.sync(1)
    assert str(err.value) == (f"sending adapter version 1: TransferError: the engine acknowledged adapter "
                              f"policy-v1 as {said}; sent version 1, 2 tensors, 64 bytes")
    assert not isinstance(err.value, EngineFailed)
    assert r.syncer.versions.active is None and r.syncer.counters["syncs"] == 0
    assert r.syncer.counters["engine_recoveries"] == 0 and r.emitter.calls.count("adapter policy-v1") == 1


def test_a_wrong_base_ack_raises_naming_what_was_sent(rig) -> None:
    r = rig()
    r.emitter.base_ack = lambda v, n, b: Ack(v, n, b + 1)
    with pytest.raises(TransferError) as err:
        r.syncer.sync(1)
    assert str(err.value) == ("checking the base's acknowledgement: TransferError: the engine acknowledged "
                              "base weights as version 1, 2 tensors, 45 bytes; sent version 1, 2 tensors, "
                              f"{BASE_BYTES} bytes")
    assert r.syncer.counters["base_sends"] == 0 and "adapter policy-v1" not in r.emitter.calls


def test_a_failed_base_is_streamed_again_after_a_back_off(rig, sleeps, caplog) -> None:
    r = rig(retries=1)
    r.emitter.fail["base"] = [TransferError("bucket 2 refused")]
    with caplog.at_level(logging.WARNING, logger="titan_lora.sync.syncer"):
        r.syncer.sync(1)
    assert r.base.starts == 2 and r.base.drawn == 4, "the failed attempt still ran the whole stream"
    assert sleeps == [1.0] and r.syncer.counters["base_sends"] == 1
    assert r.emitter.calls == ["incarnation", "base v1", "base v1", "incarnation", "adapter policy-v1"]
    assert ("sending the base failed (sending the base: TransferError: bucket 2 refused); retrying"
            in caplog.messages)


def test_a_base_that_keeps_failing_raises_after_the_retries(rig, sleeps) -> None:
    r = rig(retries=2)
    r.emitter.fail["base"] = [TransferError("refused")] * 3
    with pytest.raises(TransferError) as err:
        r.syncer.sync(1)
    assert str(err.value) == "sending the base failed after 3 attempts: sending the base: TransferError: refused"
    assert r.base.starts == 3 and sleeps == [1.0, 2.0] and r.syncer.counters["base_sends"] == 0


def test_a_transient_adapter_failure_is_retried(rig, sleeps) -> None:
    r = rig(retries=1)
    r.emitter.fail["adapter"] = [TransferError("HTTP 503")]
    r.syncer.sync(1)
    assert r.emitter.calls.count("adapter policy-v1") == 2 and sleeps == [1.0]
    assert r.syncer.versions.active.version == 1 and r.syncer.counters["engine_recoveries"] == 0


# ---- a non-finite adapter ---------------------------------------------------------------------------


def test_a_nonfinite_adapter_is_never_sent(rig) -> None:
    r = rig()
    r.source.finite = False
    with pytest.raises(NonFiniteAdapterError) as err:
        r.syncer.sync(1)
    assert str(err.value).startswith("adapter version 1 holds NaN/Inf values: it was not sent (the engine keeps "
                                     "the base). [training] on_nonfinite decides what the run does: \"stop\"")
    assert r.emitter.calls == []
    r.source.finite = True
    r.syncer.sync(1)
    r.source.finite = False
    with pytest.raises(NonFiniteAdapterError, match=r"adapter version 2 holds NaN/Inf values: it was not sent "
                                                    r"\(the engine keeps policy-v1\)\. "):
        r.syncer.sync(2)
    assert "adapter policy-v2" not in r.emitter.calls and r.syncer.versions.live == [1]


# ---- start-up and shutdown -------------------------------------------------------------------------


def test_check_engine_reads_the_limits_and_refuses_a_mismatch(rig) -> None:
    r = rig(keep_versions=2)
    r.syncer.check_engine()
    assert r.emitter.calls == ["limits"]
    r.emitter.limits = EngineLimits(4, 3, None)
    with pytest.raises(TransferError) as err:
        r.syncer.check_engine()
    assert str(err.value) == ("checking the engine's limits: TransferError: [lora] rank = 8 exceeds the "
                              "engine's max LoRA rank 4; restart the engine with --max-lora-rank >= 8 or "
                              "lower [lora] rank")


def test_check_engine_retries_and_reports_an_unreachable_engine_as_an_error(rig, sleeps) -> None:
    r = rig(retries=1)
    r.emitter.fail["limits"] = [TransferError("HTTP 502"), None]
    r.syncer.check_engine()
    assert r.emitter.calls == ["limits", "limits"] and sleeps == [1.0]
    r.emitter.fail["limits"] = [EngineWeightsLost("restarting")]
    with pytest.raises(TransferError) as err:
        r.syncer.check_engine()
    assert type(err.value) is TransferError
    assert str(err.value) == "checking the engine's limits: EngineWeightsLost: restarting"


def test_close_stops_the_retirer_then_the_engine_then_the_emitter(rig) -> None:
    r = rig(engine=True)
    order: list[str] = []
    r.syncer.retirer.close = lambda: order.append("retirer")
    r.engine.stop = lambda: order.append("engine")
    r.emitter.close = lambda: order.append("emitter")
    r.syncer.close()
    assert order == ["retirer", "engine", "emitter"]


def test_an_engine_that_stays_alive_is_checked_with_the_health_timeout(rig, sleeps) -> None:
    r = rig(engine=True, retries=1, health_timeout_s=4.0)
    r.emitter.fail["adapter"] = [TransferError("HTTP 503")]
    r.syncer.sync(1)
    assert r.engine.events.count(("check", 4.0)) >= 2 and sleeps == [1.0]  # after the failure, and before it
    assert r.syncer.counters["engine_recoveries"] == 0


# ---- what each failure says -----------------------------------------------------------------------


def test_an_engine_that_cannot_be_reached_names_what_failed(rig, sleeps) -> None:
    r = rig(retries=1)
    r.emitter.fail["incarnation"] = [TransferError("HTTP 500")] * 2
    with pytest.raises(TransferError) as err:
        r.syncer.sync(1)
    assert str(err.value) == ("sending adapter version 1: TransferError: reaching the engine failed after 2 "
                              "attempts: HTTP 500")


def test_limits_that_cannot_be_read_name_what_failed(rig, sleeps) -> None:
    r = rig(retries=1)
    r.emitter.fail["limits"] = [TransferError("HTTP 502")] * 2
    with pytest.raises(TransferError) as err:
        r.syncer.check_engine()
    assert str(err.value) == ("checking the engine's limits: TransferError: reading the engine's limits failed "
                              "after 2 attempts: HTTP 502")


def test_an_adapter_that_keeps_failing_names_the_adapter(rig, sleeps) -> None:
    r = rig(retries=1)
    r.syncer.sync(1)
    r.emitter.fail["adapter"] = [TransferError("HTTP 500")] * 2
    with pytest.raises(TransferError) as err:
        r.syncer.sync(2)
    assert str(err.value) == ("sending adapter version 2: TransferError: sending adapter policy-v2 failed after 2 "
                              "attempts: HTTP 500")
    assert r.syncer.counters["engine_recoveries"] == 0
