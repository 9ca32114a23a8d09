"""WeightSyncer in one process (no process group: rank 0 alone), against fakes that record every call.

The 2-rank tests in test_syncer.py run the real receiver; these run in milliseconds, so that each
branch of the syncer (base once per incarnation, ack checks, retries, engine recovery, the parity
gate, retention) is checked on every run of the fast suite. The oracle is the call log of the fake
emitter and engine and the numbers the fakes were given (tensors, bytes, versions), derived by hand.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from titan_lora.clients.base import AdapterPayload
from titan_lora.config import WeightSync
from titan_lora.sync import syncer as syncer_mod
from titan_lora.sync.syncer import (
    EngineFailed,
    NonFiniteAdapterError,
    WeightSyncer,
    _Tally,
    check_engine_limits,
)
from titan_lora.sync.versions import versioned_name
from titan_lora.transfer.errors import EngineDied, EngineUnreachable, EngineWeightsLost, TransferError
from titan_lora.transfer.protocol import Ack, EngineLimits

# Two base tensors: 3*2*4 + 5*4 = 44 bytes. Two adapter tensors: 2*4*4 + 4*2*4 = 64 bytes.
BASE = [("model.embed_tokens.weight", torch.ones(3, 2)), ("model.norm.weight", torch.ones(5))]
BASE_BYTES, ADAPTER_BYTES = 44, 64


def cfg(**overrides) -> WeightSync:  # noqa: ANN003
    """[weight_sync] for these tests: one retry, two engine restarts, short timeouts."""
    base = WeightSync(enabled=True, retries=1, keep_versions=2, retire_timeout_s=5.0,
                      parity_every=0, health_timeout_s=2.0, engine_start_timeout_s=30.0, engine_restarts=2)
    return dataclasses.replace(base, **overrides)


class Source:
    """AdapterSource stand-in: version v's adapter holds the value v."""

    rank = 8
    target_modules = ["q_proj", "v_proj"]

    def __init__(self) -> None:
        self.finite = True
        self.snapshots: list[int] = []

    def snapshot(self, version: int) -> AdapterPayload:
        self.snapshots.append(version)
        tensors = {"m.q_proj.lora_A.weight": torch.full((2, 4), float(version)),
                   "m.q_proj.lora_B.weight": torch.zeros(4, 2)}
        return AdapterPayload(versioned_name("policy", version), version, tensors, {"r": 2})

    def snapshot_is_finite(self) -> bool:
        return self.finite


class Base:
    """The base stream: counts how often it was started and how many tensors were drawn from it."""

    def __init__(self) -> None:
        self.starts = 0
        self.drawn = 0

    def __call__(self):  # noqa: ANN204
        self.starts += 1
        for name, t in BASE:
            self.drawn += 1
            yield name, t


class Emitter:
    """Records calls; `fail[method]` lists errors to raise on its next calls (None: succeed)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.incarnation = "inc-1"
        self.limits = EngineLimits(8, 3, frozenset({"q_proj", "v_proj"}))
        self.fail: dict[str, list[BaseException | None]] = {}
        self.adapter_ack = None  # payload -> Ack, to lie
        self.base_ack = None  # (version, tensors, bytes) -> Ack, to lie
        self.unload_answer = True
        self.unloaded: list[tuple[str, float]] = []

    def _maybe_fail(self, what: str) -> None:
        errors = self.fail.get(what)
        if errors:
            err = errors.pop(0)
            if err is not None:
                raise err

    def engine_limits(self) -> EngineLimits:
        self.calls.append("limits")
        self._maybe_fail("limits")
        return self.limits

    def engine_incarnation(self) -> str:
        self.calls.append("incarnation")
        self._maybe_fail("incarnation")
        return self.incarnation

    def send_base(self, tensors, version: int) -> Ack:  # noqa: ANN001
        self.calls.append(f"base v{version}")
        self._maybe_fail("base")
        got = list(tensors)
        n, nbytes = len(got), sum(t.numel() * t.element_size() for _, t in got)
        return self.base_ack(version, n, nbytes) if self.base_ack else Ack(version, n, nbytes)

    def send_adapter(self, payload: AdapterPayload) -> Ack:
        self.calls.append(f"adapter {payload.name}")
        self._maybe_fail("adapter")
        if self.adapter_ack:
            return self.adapter_ack(payload)
        return Ack(payload.version, payload.num_tensors, payload.nbytes, {"transfer_ms": 2.5})

    def retire_adapter(self, name: str, timeout_s: float) -> bool:
        self.unloaded.append((name, timeout_s))
        return self.unload_answer

    def close(self) -> None:
        self.calls.append("close")


class Engine:
    """EmbeddedEngine stand-in: `alive` answers the health checks; ensure_running revives it."""

    log_path = "/runs/engine.log"

    def __init__(self) -> None:
        self.alive = True
        self.events: list[object] = []

    def healthy(self, timeout_s: float) -> bool:
        self.events.append(("healthy", timeout_s))
        return self.alive

    def check(self, timeout_s: float) -> None:
        self.events.append(("check", timeout_s))
        if not self.alive:
            raise EngineDied("the engine exited")

    def ensure_running(self) -> bool:
        self.events.append("restart")
        self.alive = True
        return True

    def stop(self) -> None:
        self.events.append("stop")

    def log_tail(self) -> str:
        return "engine: last line"


class Probe:
    """ParityProbe stand-in: reports `worst` as the max |trainer - engine| gap."""

    tolerance = 0.1

    def __init__(self, worst: float = 0.5) -> None:
        self.worst = worst
        self.compared: list[str] = []
        self.fail = False

    def trainer_side(self) -> list[list[float]]:
        return [[-1.0]]

    def compare(self, ours: list[list[float]], adapter: str) -> dict[str, float]:
        assert ours == [[-1.0]]
        self.compared.append(adapter)
        if self.fail:
            raise RuntimeError("score request failed")
        return {"parity_max_abs": self.worst, "parity_mean_abs": self.worst / 2}


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Back-off and polling delays, recorded instead of slept."""
    delays: list[float] = []
    monkeypatch.setattr(syncer_mod.time, "sleep", delays.append)
    return delays


@dataclasses.dataclass
class Rig:
    syncer: WeightSyncer
    emitter: Emitter
    source: Source
    base: Base
    engine: Engine | None
    probe: Probe | None


@pytest.fixture
def rig(sleeps):  # noqa: ANN001, ANN201
    """make(**cfg overrides, engine=False, probe=None) -> Rig; every syncer made is closed after the test."""
    made: list[WeightSyncer] = []

    def make(engine: bool = False, probe: Probe | None = None, **overrides) -> Rig:  # noqa: ANN003
        em, src, base = Emitter(), Source(), Base()
        eng = Engine() if engine else None
        s = WeightSyncer(src, base, em, cfg(**overrides), torch.device("cpu"), engine=eng, probe=probe)
        made.append(s)
        return Rig(s, em, src, base, eng, probe)

    yield make
    for s in made:
        s.retirer.close()


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


def test_the_tally_counts_what_passes_and_drain_runs_the_rest() -> None:
    base = Base()
    tally = _Tally(base())
    assert iter(tally) is tally
    assert next(tally)[0] == "model.embed_tokens.weight"
    assert (tally.tensors, tally.nbytes, base.drawn) == (1, 24, 1)
    tally.drain()
    assert (tally.tensors, tally.nbytes, base.drawn) == (2, BASE_BYTES, 2)


# ---- the happy path ------------------------------------------------------------------------------


def test_a_new_syncer_holds_nothing_yet(rig) -> None:  # noqa: ANN001
    r = rig(lora_name="pol", keep_versions=3)
    s = r.syncer
    assert s.versions.lora_name == "pol" and s.versions.keep_versions == 3 and s.versions.live == []
    assert s.counters == {"base_sends": 0, "syncs": 0, "engine_recoveries": 0, "probe_failures": 0,
                          "parity_gated": 0}
    assert s.last_metrics == {} and s.source is r.source and s.emitter is r.emitter
    assert s.device == torch.device("cpu") and s.base_weights is r.base and s.cfg.lora_name == "pol"


def test_first_sync_sends_the_base_then_the_adapter_and_publishes_it(rig) -> None:  # noqa: ANN001
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
        "sync/base_sends": 1.0, "sync/syncs": 1.0, "sync/engine_recoveries": 0.0, "sync/probe_failures": 0.0,
        "sync/parity_gated": 0.0,
    }
    assert all(isinstance(v, float) and v >= 0 for v in timed.values())
    assert r.syncer.last_metrics == {**metrics, **timed}


def test_the_base_goes_once_per_engine_incarnation(rig) -> None:  # noqa: ANN001
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


def test_sync_timings_are_milliseconds_of_the_clock(rig, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    clock = iter(range(100, 200))  # every reading advances one second
    monkeypatch.setattr(syncer_mod.time, "perf_counter", lambda: float(next(clock)))
    metrics = rig().syncer.sync(1)
    # sync: started=100, t0=101, gather ends 102; the base: started=103, done 104; the sync ends at 105.
    assert (metrics["sync/gather_ms"], metrics["sync/base_ms"], metrics["sync/total_ms"]) == (1e3, 1e3, 5e3)


def test_versions_outside_the_window_are_retired_after_publishing(rig) -> None:  # noqa: ANN001
    r = rig(keep_versions=2, retire_timeout_s=4.0)
    for v in (1, 2, 3):
        r.syncer.sync(v)
    assert r.syncer.retirer.wait_idle(5.0)
    assert r.emitter.unloaded == [("policy-v1", 2.0)] and r.syncer.versions.live == [2, 3]


def test_an_install_waits_for_lagging_retirements_only_past_keep_versions(rig) -> None:  # noqa: ANN001
    r = rig(keep_versions=2, retire_timeout_s=4.0)
    r.emitter.unload_answer = False  # "not drained yet": version 1 stays live
    waits: list[float] = []
    real_wait = r.syncer.retirer.wait_idle
    r.syncer.retirer.wait_idle = lambda timeout_s: waits.append(timeout_s) or real_wait(timeout_s)
    r.syncer.sync(1)
    r.syncer.sync(2)
    r.syncer.sync(3)  # live [1, 2] when installing: within keep_versions
    assert waits == []
    real_wait(5.0)
    metrics = r.syncer.sync(4)  # live [1, 2, 3] when installing: one past the window
    assert waits == [4.0]
    assert metrics["sync/retire_failed"] >= 1.0 and metrics["sync/retired"] == 0.0


# ---- what the engine acknowledges ------------------------------------------------------------------


@pytest.mark.parametrize("lie, said", [
    (lambda p: Ack(p.version, p.num_tensors, p.nbytes + 1), "version 1, 2 tensors, 65 bytes"),
    (lambda p: Ack(p.version, p.num_tensors - 1, p.nbytes), "version 1, 1 tensors, 64 bytes"),
    (lambda p: Ack(p.version + 1, p.num_tensors, p.nbytes), "version 2, 2 tensors, 64 bytes"),
])
def test_a_wrong_adapter_ack_raises_and_publishes_nothing(rig, lie, said: str) -> None:  # noqa: ANN001
    r = rig()
    r.emitter.adapter_ack = lie
    with pytest.raises(TransferError) as err:
        r.syncer.sync(1)
    assert str(err.value) == (f"sending adapter version 1: TransferError: the engine acknowledged adapter "
                              f"policy-v1 as {said}; sent version 1, 2 tensors, 64 bytes")
    assert not isinstance(err.value, EngineFailed)
    assert r.syncer.versions.active is None and r.syncer.counters["syncs"] == 0
    assert r.syncer.counters["engine_recoveries"] == 0 and r.emitter.calls.count("adapter policy-v1") == 1


def test_a_wrong_base_ack_raises_naming_what_was_sent(rig) -> None:  # noqa: ANN001
    r = rig()
    r.emitter.base_ack = lambda v, n, b: Ack(v, n, b + 1)
    with pytest.raises(TransferError) as err:
        r.syncer.sync(1)
    assert str(err.value) == ("checking the base's acknowledgement: TransferError: the engine acknowledged "
                              "base weights as version 1, 2 tensors, 45 bytes; sent version 1, 2 tensors, "
                              f"{BASE_BYTES} bytes")
    assert r.syncer.counters["base_sends"] == 0 and "adapter policy-v1" not in r.emitter.calls


def test_a_failed_base_is_streamed_again_after_a_back_off(rig, sleeps, caplog) -> None:  # noqa: ANN001
    r = rig(retries=1)
    r.emitter.fail["base"] = [TransferError("bucket 2 refused")]
    with caplog.at_level(logging.WARNING, logger="titan_lora.sync.syncer"):
        r.syncer.sync(1)
    assert r.base.starts == 2 and r.base.drawn == 4, "the failed attempt still ran the whole stream"
    assert sleeps == [1.0] and r.syncer.counters["base_sends"] == 1
    assert r.emitter.calls == ["incarnation", "base v1", "base v1", "incarnation", "adapter policy-v1"]
    assert ("sending the base failed (sending the base: TransferError: bucket 2 refused); retrying"
            in caplog.messages)


def test_a_base_that_keeps_failing_raises_after_the_retries(rig, sleeps) -> None:  # noqa: ANN001
    r = rig(retries=2)
    r.emitter.fail["base"] = [TransferError("refused")] * 3
    with pytest.raises(TransferError) as err:
        r.syncer.sync(1)
    assert str(err.value) == "sending the base failed after 3 attempts: sending the base: TransferError: refused"
    assert r.base.starts == 3 and sleeps == [1.0, 2.0] and r.syncer.counters["base_sends"] == 0


def test_a_transient_adapter_failure_is_retried(rig, sleeps) -> None:  # noqa: ANN001
    r = rig(retries=1)
    r.emitter.fail["adapter"] = [TransferError("HTTP 503")]
    r.syncer.sync(1)
    assert r.emitter.calls.count("adapter policy-v1") == 2 and sleeps == [1.0]
    assert r.syncer.versions.active.version == 1 and r.syncer.counters["engine_recoveries"] == 0


# ---- a non-finite adapter ---------------------------------------------------------------------------


def test_a_nonfinite_adapter_is_never_sent(rig) -> None:  # noqa: ANN001
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


# ---- engine faults and recovery --------------------------------------------------------------------


def test_weights_lost_mid_sync_resends_the_base_then_the_adapter(rig, caplog) -> None:  # noqa: ANN001
    r = rig()
    r.syncer.sync(1)
    r.emitter.calls.clear()
    r.emitter.fail["adapter"] = [EngineWeightsLost("no base")]
    with caplog.at_level(logging.WARNING, logger="titan_lora.sync.syncer"):
        metrics = r.syncer.sync(2)
    # revive (attached: reachable), base of the current version 1, then the sync's own transfer again
    assert r.emitter.calls == ["incarnation", "adapter policy-v2", "incarnation", "incarnation", "base v1",
                               "incarnation", "incarnation", "adapter policy-v2"]
    assert metrics["sync/engine_recoveries"] == 1.0 and metrics["sync/base_sends"] == 2.0
    assert "sync/base_ms" in metrics and metrics["sync/published"] == 1.0
    assert r.source.snapshots == [1, 2], "a sync's recovery does not re-send the previous version"
    assert r.syncer.versions.live == [2]
    assert "sending adapter version 2: EngineWeightsLost: no base; recovering the engine (1 of 2)" in caplog.messages


def test_with_engine_recovers_and_republishes_the_newest_version(rig) -> None:  # noqa: ANN001
    r = rig()
    r.syncer.sync(1)
    r.syncer.sync(2)
    r.emitter.calls.clear()
    answers = iter([EngineUnreachable("connection refused"), "served"])

    def rollouts() -> str:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert r.syncer.with_engine(rollouts, "rollouts of step 3") == "served"
    assert r.emitter.calls == ["incarnation", "incarnation", "base v2", "incarnation", "adapter policy-v2"]
    assert r.source.snapshots == [1, 2, 2] and r.syncer.versions.live == [2]
    assert r.syncer.versions.active.name == "policy-v2" and r.syncer.counters["engine_recoveries"] == 1


def test_with_engine_returns_the_value_and_leaves_the_engine_alone(rig) -> None:  # noqa: ANN001
    r = rig()
    assert r.syncer.with_engine(lambda: 7, "eval") == 7
    assert r.emitter.calls == [] and r.syncer.counters["engine_recoveries"] == 0


def test_a_version_the_gate_held_back_is_not_resent_after_a_restart(rig) -> None:  # noqa: ANN001
    r = rig(parity_every=1, parity_gate=True, probe=Probe(worst=0.5))
    r.syncer.sync(1)
    assert r.syncer.versions.active is None
    r.emitter.calls.clear()
    calls = iter([EngineUnreachable("down"), None])

    def fn() -> None:
        if (err := next(calls)) is not None:
            raise err

    r.syncer.with_engine(fn, "rollouts")
    assert r.emitter.calls == ["incarnation", "incarnation", "base v1", "incarnation"]
    assert r.source.snapshots == [1]


def test_an_engine_that_keeps_failing_ends_in_engine_failed(rig) -> None:  # noqa: ANN001
    r = rig(engine_restarts=2)
    r.syncer.sync(1)

    def fn() -> None:
        raise EngineUnreachable("connection refused")

    with pytest.raises(EngineFailed) as err:
        r.syncer.with_engine(fn, "rollouts of step 2")
    assert str(err.value) == ("rollouts of step 2: the engine still fails after 2 recoveries ([weight_sync] "
                              "engine_restarts); last error: rollouts of step 2: EngineUnreachable: connection "
                              "refused")
    assert r.syncer.counters["engine_recoveries"] == 2 and r.emitter.calls.count("base v1") == 3


def test_no_restarts_allowed_fails_at_once(rig) -> None:  # noqa: ANN001
    r = rig(engine_restarts=0)

    def fn() -> None:
        raise EngineUnreachable("down")

    with pytest.raises(EngineFailed, match=r"^eval: the engine still fails after 0 recoveries"):
        r.syncer.with_engine(fn, "eval")
    assert r.syncer.counters["engine_recoveries"] == 0 and r.emitter.calls == []


def test_an_embedded_engine_that_dies_is_restarted_and_its_log_is_shown(rig) -> None:  # noqa: ANN001
    r = rig(engine=True, engine_restarts=1, health_timeout_s=3.0)
    r.syncer.sync(1)
    r.engine.events.clear()

    def fn() -> None:
        r.engine.alive = False
        raise EngineUnreachable("reset")

    with pytest.raises(EngineFailed) as err:
        r.syncer.with_engine(fn, "rollouts")
    assert str(err.value).endswith("last error: rollouts: EngineUnreachable: reset\n"
                                   "last lines of /runs/engine.log:\nengine: last line")
    assert r.engine.events[:3] == ["restart", ("check", 3.0), ("check", 3.0)]


def test_a_failed_recovery_is_named_beside_the_last_error(rig) -> None:  # noqa: ANN001
    r = rig(engine=True, engine_restarts=1)
    r.syncer.sync(1)

    def fn() -> None:
        r.engine.alive = False
        raise EngineUnreachable("reset")

    def no_start() -> bool:
        raise EngineDied("the engine exited at start: address already in use")

    r.engine.ensure_running = no_start
    with pytest.raises(EngineFailed) as err:
        r.syncer.with_engine(fn, "rollouts")
    assert "last error: rollouts: EngineUnreachable: reset; last recovery failed: bringing the engine back: " \
           "EngineDied: the engine exited at start: address already in use" in str(err.value)


def test_an_embedded_engine_that_hangs_is_not_retried_but_restarted(rig, sleeps) -> None:  # noqa: ANN001
    r = rig(engine=True, retries=3, health_timeout_s=3.0)
    r.syncer.sync(1)
    r.engine.events.clear()
    r.emitter.calls.clear()

    def hang(payload: AdapterPayload) -> Ack:
        r.engine.alive = False
        r.emitter.adapter_ack = None
        raise TransferError("timed out")

    r.emitter.adapter_ack = hang
    r.syncer.sync(2)
    assert sleeps == [], "a dead engine is not retried with back-off"
    # the transfer's check, the failed request's health check, the restart, then the base and transfer checks
    assert r.engine.events == [("check", 3.0), ("healthy", 3.0), "restart"] + [("check", 3.0)] * 3
    assert r.emitter.calls.count("base v1") == 1 and r.syncer.versions.active.name == "policy-v2"


def test_an_error_with_the_engine_gone_is_an_engine_fault(rig) -> None:  # noqa: ANN001
    r = rig(engine=True)
    r.syncer.sync(1)
    lies = iter([True, False])

    def ack(p: AdapterPayload) -> Ack:
        if next(lies):  # a wrong ack, and the engine died meanwhile
            r.engine.alive = False
            return Ack(p.version, 0, 0)
        return Ack(p.version, p.num_tensors, p.nbytes)

    r.emitter.adapter_ack = ack
    r.syncer.sync(2)
    assert r.syncer.counters["engine_recoveries"] == 1 and r.syncer.versions.active.name == "policy-v2"


def test_a_changed_incarnation_after_an_error_is_an_engine_fault(rig) -> None:  # noqa: ANN001
    r = rig()
    r.syncer.sync(1)

    def ack(p: AdapterPayload) -> Ack:
        r.emitter.adapter_ack = None
        r.emitter.incarnation = "inc-2"  # restarted while we sent: the wrong ack is a lost engine
        return Ack(p.version, 0, 0)

    r.emitter.adapter_ack = ack
    r.syncer.sync(2)
    assert r.syncer.counters["engine_recoveries"] == 1 and r.syncer.counters["base_sends"] == 2


def test_an_unreachable_incarnation_after_an_error_is_an_engine_fault(rig, sleeps) -> None:  # noqa: ANN001
    r = rig(retries=0)
    r.syncer.sync(1)
    r.emitter.fail["adapter"] = [TransferError("HTTP 500")]
    r.emitter.fail["incarnation"] = [None, EngineUnreachable("refused")]  # the transfer's check, then down
    r.syncer.sync(2)
    assert r.syncer.counters["engine_recoveries"] == 1 and r.syncer.versions.active.name == "policy-v2"


def test_a_failing_health_check_counts_as_a_lost_engine(rig, caplog) -> None:  # noqa: ANN001
    r = rig(engine=True)
    r.syncer.sync(1)

    def broken(timeout_s: float) -> bool:
        r.engine.healthy = lambda timeout_s: True
        raise RuntimeError("health endpoint crashed")

    r.engine.healthy = broken
    r.emitter.adapter_ack = lambda p: (setattr(r.emitter, "adapter_ack", None), Ack(p.version, 0, 0))[1]
    with caplog.at_level(logging.ERROR, logger="titan_lora.sync.syncer"):
        r.syncer.sync(2)
    assert "checking the engine's health failed; treating it as lost" in caplog.messages
    assert r.syncer.counters["engine_recoveries"] == 1


def test_an_error_before_any_base_is_not_an_engine_fault(rig) -> None:  # noqa: ANN001
    r = rig()

    def fn() -> None:
        raise TransferError("HTTP 400: bad prompt")

    with pytest.raises(TransferError) as err:
        r.syncer.with_engine(fn, "rollouts")
    assert str(err.value) == "rollouts: TransferError: HTTP 400: bad prompt"
    assert r.syncer.counters["engine_recoveries"] == 0 and r.emitter.calls == []


def test_an_attached_engine_is_polled_until_it_answers(rig, sleeps) -> None:  # noqa: ANN001
    r = rig(health_timeout_s=0.5)
    r.syncer.sync(1)
    r.emitter.calls.clear()
    r.emitter.fail["incarnation"] = [EngineUnreachable("refused")] * 2
    failures = iter([EngineUnreachable("refused"), None])

    def fn() -> str:
        if (err := next(failures)) is not None:
            raise err
        return "ok"

    assert r.syncer.with_engine(fn, "rollouts") == "ok"
    assert sleeps == [0.5, 0.5] and r.emitter.calls[:3] == ["incarnation"] * 3


def test_polling_an_attached_engine_is_bounded(rig, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    now = [100.0]
    monkeypatch.setattr(syncer_mod.time, "monotonic", lambda: now[0])
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    monkeypatch.setattr(syncer_mod.time, "sleep", sleep)
    r = rig(health_timeout_s=5.0, engine_start_timeout_s=6.0)
    r.emitter.fail["incarnation"] = [EngineUnreachable("refused")] * 10
    with pytest.raises(EngineUnreachable) as err:
        r.syncer._revive()
    assert str(err.value) == ("the attached engine ([engine] url) did not come back within 6 s ([weight_sync] "
                              "engine_start_timeout_s); last error: refused")
    assert slept == [2.0, 2.0, 2.0, 2.0], "min(health timeout, 2 s) apart, until past the deadline"


# ---- the parity probe and gate ---------------------------------------------------------------------


def test_the_probe_runs_every_n_syncs_and_reports_its_figures(rig) -> None:  # noqa: ANN001
    probe = Probe(worst=0.5)
    r = rig(parity_every=2, probe=probe)
    first = r.syncer.sync(1)
    second = r.syncer.sync(2)
    third = r.syncer.sync(3)
    assert probe.compared == ["policy-v1", "policy-v3"]
    assert first["sync/parity_max_abs"] == 0.5 and first["sync/parity_mean_abs"] == 0.25
    assert "sync/parity_max_abs" not in second and third["sync/parity_max_abs"] == 0.5
    assert first["sync/published"] == 1.0, "without the gate a violation is published"


def test_no_probe_when_parity_every_is_zero(rig) -> None:  # noqa: ANN001
    probe = Probe()
    r = rig(parity_every=0, probe=probe)
    r.syncer.sync(1)
    assert probe.compared == []


def test_the_gate_holds_back_a_version_over_the_tolerance(rig, caplog) -> None:  # noqa: ANN001
    r = rig(parity_every=1, parity_gate=True, probe=Probe(worst=0.5), retire_timeout_s=4.0)
    with caplog.at_level(logging.WARNING, logger="titan_lora.sync.syncer"):
        metrics = r.syncer.sync(1)
    assert metrics["sync/published"] == 0.0 and metrics["sync/parity_gated"] == 1.0
    assert "sync/live_versions" not in metrics and r.syncer.versions.active is None
    assert r.syncer.retirer.wait_idle(5.0) and r.emitter.unloaded == [("policy-v1", 2.0)]
    assert ("adapter policy-v1 not published: parity 0.5 > [weight_sync] parity_tolerance 0.1; the engine "
            "keeps serving None") in caplog.messages


def test_the_gate_publishes_a_version_within_the_tolerance(rig) -> None:  # noqa: ANN001
    r = rig(parity_every=1, parity_gate=True, probe=Probe(worst=0.1))
    assert r.syncer.sync(1)["sync/published"] == 1.0 and r.syncer.versions.active.version == 1


def test_a_failed_probe_is_counted_and_never_stops_or_gates(rig, caplog) -> None:  # noqa: ANN001
    probe = Probe()
    probe.fail = True
    r = rig(parity_every=1, parity_gate=True, probe=probe)
    with caplog.at_level(logging.WARNING, logger="titan_lora.sync.syncer"):
        metrics = r.syncer.sync(1)
    assert metrics["sync/probe_failures"] == 1.0 and metrics["sync/published"] == 1.0
    assert "sync/parity_max_abs" not in metrics
    assert any(m.startswith("the parity probe failed (") and m.endswith("); training goes on")
               for m in caplog.messages)


# ---- start-up and shutdown -------------------------------------------------------------------------


def test_check_engine_reads_the_limits_and_refuses_a_mismatch(rig) -> None:  # noqa: ANN001
    r = rig(keep_versions=2)
    r.syncer.check_engine()
    assert r.emitter.calls == ["limits"]
    r.emitter.limits = EngineLimits(4, 3, None)
    with pytest.raises(TransferError) as err:
        r.syncer.check_engine()
    assert str(err.value) == ("checking the engine's limits: TransferError: [lora] rank = 8 exceeds the "
                              "engine's max LoRA rank 4; restart the engine with --max-lora-rank >= 8 or "
                              "lower [lora] rank")


def test_check_engine_retries_and_reports_an_unreachable_engine_as_an_error(rig, sleeps) -> None:  # noqa: ANN001
    r = rig(retries=1)
    r.emitter.fail["limits"] = [TransferError("HTTP 502"), None]
    r.syncer.check_engine()
    assert r.emitter.calls == ["limits", "limits"] and sleeps == [1.0]
    r.emitter.fail["limits"] = [EngineWeightsLost("restarting")]
    with pytest.raises(TransferError) as err:
        r.syncer.check_engine()
    assert type(err.value) is TransferError
    assert str(err.value) == "checking the engine's limits: EngineWeightsLost: restarting"


def test_close_stops_the_retirer_then_the_engine_then_the_emitter(rig) -> None:  # noqa: ANN001
    r = rig(engine=True)
    order: list[str] = []
    r.syncer.retirer.close = lambda: order.append("retirer")
    r.engine.stop = lambda: order.append("engine")
    r.emitter.close = lambda: order.append("emitter")
    r.syncer.close()
    assert order == ["retirer", "engine", "emitter"]


def test_an_engine_that_stays_alive_is_checked_with_the_health_timeout(rig, sleeps) -> None:  # noqa: ANN001
    r = rig(engine=True, retries=1, health_timeout_s=4.0)
    r.emitter.fail["adapter"] = [TransferError("HTTP 503")]
    r.syncer.sync(1)
    assert ("healthy", 4.0) in r.engine.events and sleeps == [1.0]
    assert ("check", 4.0) in r.engine.events and r.syncer.counters["engine_recoveries"] == 0


# ---- what each failure says, and the paths the first tests leave out -------------------------------


def test_an_engine_that_cannot_be_reached_names_what_failed(rig, sleeps) -> None:  # noqa: ANN001
    r = rig(retries=1)
    r.emitter.fail["incarnation"] = [TransferError("HTTP 500")] * 2
    with pytest.raises(TransferError) as err:
        r.syncer.sync(1)
    assert str(err.value) == ("reaching the engine: TransferError: reaching the engine failed after 2 attempts: "
                              "HTTP 500")


def test_limits_that_cannot_be_read_name_what_failed(rig, sleeps) -> None:  # noqa: ANN001
    r = rig(retries=1)
    r.emitter.fail["limits"] = [TransferError("HTTP 502")] * 2
    with pytest.raises(TransferError) as err:
        r.syncer.check_engine()
    assert str(err.value) == ("checking the engine's limits: TransferError: reading the engine's limits failed "
                              "after 2 attempts: HTTP 502")


def test_an_adapter_that_keeps_failing_names_the_adapter(rig, sleeps) -> None:  # noqa: ANN001
    r = rig(retries=1)
    r.syncer.sync(1)
    r.emitter.fail["adapter"] = [TransferError("HTTP 500")] * 2
    with pytest.raises(TransferError) as err:
        r.syncer.sync(2)
    assert str(err.value) == ("sending adapter version 2: TransferError: sending adapter policy-v2 failed after 2 "
                              "attempts: HTTP 500")
    assert r.syncer.counters["engine_recoveries"] == 0


def test_a_wrong_ack_when_resending_after_a_restart_names_the_version(rig) -> None:  # noqa: ANN001
    r = rig()
    r.syncer.sync(1)
    r.syncer.sync(2)
    r.emitter.adapter_ack = lambda p: Ack(p.version, p.num_tensors, 1)
    failures = iter([EngineUnreachable("down")])

    def fn() -> None:
        if (err := next(failures, None)) is not None:
            raise err

    with pytest.raises(TransferError) as err:
        r.syncer.with_engine(fn, "rollouts")
    assert str(err.value) == ("re-sending adapter version 2: TransferError: the engine acknowledged adapter "
                              "policy-v2 as version 2, 2 tensors, 1 bytes; sent version 2, 2 tensors, 64 bytes")


def test_an_engine_that_errs_while_being_brought_back_says_so(rig) -> None:  # noqa: ANN001
    r = rig()
    r.syncer.sync(1)
    r.emitter.fail["incarnation"] = [TransferError("HTTP 401")]  # the revival's check; then it answers

    def fn() -> None:
        raise EngineUnreachable("down")

    with pytest.raises(TransferError) as err:
        r.syncer.with_engine(fn, "rollouts")
    assert str(err.value) == "bringing the engine back: TransferError: HTTP 401"


def test_recovering_before_any_sync_sends_base_version_zero(rig) -> None:  # noqa: ANN001
    r = rig()
    failures = iter([EngineUnreachable("down")])

    def fn() -> str:
        if (err := next(failures, None)) is not None:
            raise err
        return "ok"

    assert r.syncer.with_engine(fn, "eval") == "ok"
    assert r.emitter.calls == ["incarnation", "incarnation", "base v0", "incarnation"]
    assert r.source.snapshots == [], "no version was published yet: none is re-sent"


def test_the_base_send_is_logged_with_its_size_and_time(rig, caplog, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    clock = iter(range(100))
    monkeypatch.setattr(syncer_mod.time, "perf_counter", lambda: float(next(clock)) * 100.0)
    with caplog.at_level(logging.INFO, logger="titan_lora.sync.syncer"):
        rig().syncer.sync(1)
    assert "sent the base weights (2 tensors) in 100.0 s" in caplog.messages


def test_a_healthy_engine_does_not_turn_an_error_into_a_recovery(rig) -> None:  # noqa: ANN001
    r = rig(engine=True, health_timeout_s=3.5)
    r.syncer.sync(1)
    r.emitter.adapter_ack = lambda p: Ack(p.version, 0, 0)
    r.engine.events.clear()
    with pytest.raises(TransferError, match="^sending adapter version 2: TransferError: the engine acknowledged"):
        r.syncer.sync(2)
    assert r.syncer.counters["engine_recoveries"] == 0 and ("healthy", 3.5) in r.engine.events


def test_every_gated_version_and_failed_probe_is_counted_and_logged(rig, caplog) -> None:  # noqa: ANN001
    probe = Probe(worst=0.05)
    r = rig(parity_every=1, parity_gate=True, probe=probe, retire_timeout_s=4.0)
    r.syncer.sync(1)  # within the tolerance: published
    probe.worst = 0.5
    with caplog.at_level(logging.WARNING, logger="titan_lora.sync.syncer"):
        r.syncer.sync(2)
        r.syncer.sync(3)
    assert r.syncer.counters["parity_gated"] == 2 and r.syncer.versions.active.name == "policy-v1"
    assert ("adapter policy-v2 not published: parity 0.5 > [weight_sync] parity_tolerance 0.1; the engine keeps "
            "serving Lease(name='policy-v1', version=1)") in caplog.messages
    assert r.syncer.retirer.wait_idle(5.0) and r.syncer.retirer.retired == 2
    assert [n for n, _ in r.emitter.unloaded] == ["policy-v2", "policy-v3"]
    probe.fail = True
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="titan_lora.sync.syncer"):
        r.syncer.sync(4)
        r.syncer.sync(5)
    assert r.syncer.counters["probe_failures"] == 2
    assert [r.getMessage() for r in caplog.records if r.name == "titan_lora.sync.syncer"][0] == (
        "the parity probe failed (the parity probe: RuntimeError: score request failed); "
                                  "training goes on")


def test_a_gated_version_is_retired_even_with_nothing_active(rig) -> None:  # noqa: ANN001
    r = rig(parity_every=1, parity_gate=True, probe=Probe(worst=0.5), retire_timeout_s=4.0)
    r.syncer.sync(1)
    assert r.syncer.retirer.wait_idle(5.0) and r.syncer.retirer.retired == 1


def test_other_ranks_probe_without_a_payload_and_publish_nothing(sleeps) -> None:  # noqa: ANN001
    probe = Probe()
    other = WeightSyncer(Source(), Base(), None, cfg(parity_every=1), torch.device("cpu"), probe=probe)
    assert other.retirer is None
    assert other._maybe_probe_and_publish(None) == {}
    assert probe.compared == [], "only rank 0 asks the engine"
    other.close()


def test_a_sync_whose_engine_keeps_failing_names_the_version(rig) -> None:  # noqa: ANN001
    r = rig(engine_restarts=1)
    r.syncer.sync(1)
    r.emitter.fail["adapter"] = [EngineWeightsLost("no base")] * 2
    with pytest.raises(EngineFailed) as err:
        r.syncer.sync(2)
    assert str(err.value).startswith("syncing adapter version 2: the engine still fails after 1 recoveries")


def test_an_engine_that_errs_right_after_coming_back_ends_the_recovery(rig) -> None:  # noqa: ANN001
    r = rig(retries=0)
    r.syncer.sync(1)
    # the revival reaches it; then reading its incarnation for the base fails with a plain error
    r.emitter.fail["incarnation"] = [None, TransferError("HTTP 500")]

    def fn() -> None:
        raise EngineUnreachable("down")

    with pytest.raises(TransferError) as err:
        r.syncer.with_engine(fn, "rollouts")
    assert str(err.value) == ("reaching the engine: TransferError: reaching the engine failed after 1 attempts: "
                              "HTTP 500")
    assert r.syncer.counters["engine_recoveries"] == 1
