"""The watchdog over a wedged engine: units on a scripted check, then a WeightSyncer on 2 gloo ranks into the
real receiver whose transfer path wedges while its front (INFO) still answers, embedded (killed and
restarted) and attached (waited for). The oracle: the time to detection, the recovery counters, and the
bytes the receiver holds afterwards."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from dist_helpers import run_ranks
from syncer_helpers import (
    build_syncer,
    engine_adapters,
    engine_digest,
    expected_adapter,
    shim_on_path,
    start_receiver,
    sync_cfg,
)
from test_syncer import digests

from titan_lora.sync.watchdog import Watchdog
from titan_lora.transfer.errors import EngineHung

PAUSE_ENV, MARKER_ENV = "TITAN_LORA_FAULT_BUCKET_PAUSE_S", "TITAN_LORA_FAULT_MARKER"


class Script:
    """A liveness check that fails while `wedged`, and an on_wedge that records its reasons."""

    def __init__(self) -> None:
        self.wedged = False
        self.checks = 0
        self.reasons: list[str] = []
        self.ended = threading.Event()

    def check_live(self, timeout_s: float) -> None:
        self.checks += 1
        if self.wedged:
            raise EngineHung(f"no answer within {timeout_s} s")

    def on_wedge(self, reason: str) -> None:
        self.reasons.append(reason)
        self.ended.set()


def test_a_wedge_ends_the_waiting_operation_within_one_and_a_half_timeouts() -> None:
    script, timeout_s = Script(), 0.4
    dog = Watchdog(script.check_live, script.on_wedge, timeout_s)
    try:
        with dog.watching("rollouts of step 4"):
            time.sleep(0.3)
            script.wedged = True
            wedged_at = time.monotonic()
            assert script.ended.wait(5), "the wedge was never reported"
            found_after = time.monotonic() - wedged_at
        assert found_after <= 1.5 * timeout_s + 0.2, f"found {found_after:.2f} s after the wedge"
        assert len(script.reasons) == 1 and script.reasons[0].startswith("rollouts of step 4: ")
        assert dog.wedges == 1
    finally:
        dog.close()


def test_nothing_is_checked_between_operations_and_one_wedge_is_reported_once() -> None:
    script, timeout_s = Script(), 0.2
    dog = Watchdog(script.check_live, script.on_wedge, timeout_s)
    try:
        time.sleep(0.5)
        assert script.checks == 0, "the engine was asked while nothing waited on it"
        script.wedged = True
        with dog.watching("a base send"):
            time.sleep(1.0)  # several periods: still one report for this operation
        assert script.reasons and len(script.reasons) == 1
        checks = script.checks
        time.sleep(0.5)
        assert script.checks == checks, "checked after the operation ended"
    finally:
        dog.close()


def test_an_on_wedge_that_raises_is_logged_and_the_watch_goes_on(caplog) -> None:
    script, timeout_s = Script(), 0.2
    failures = ["the engine's process did not exit within 30 s of SIGKILL"]

    def on_wedge(reason: str) -> None:
        if failures:  # the first kill times out (a process stuck in the kernel), the next one works
            raise TimeoutError(failures.pop())
        script.on_wedge(reason)

    dog = Watchdog(script.check_live, on_wedge, timeout_s)
    try:
        script.wedged = True
        with dog.watching("rollouts of step 7"):
            assert script.ended.wait(5), "the watchdog stopped after on_wedge raised"
        assert dog.wedges == 1 and script.reasons[0].startswith("rollouts of step 7: ")
        assert any("ending the wait of rollouts of step 7 on the wedged engine failed" in r.getMessage()
                   and r.exc_info for r in caplog.records), "the failure was not logged"
        script.ended.clear()
        with dog.watching("a base send"):  # a later wedge is seen too
            assert script.ended.wait(5), "a later wedge was not seen"
        assert dog.wedges == 2
    finally:
        dog.close()


def _arm(marker: Path) -> None:
    marker.unlink()  # the receiver's next bucket touches it again and sleeps inside the transfer path


def _wedged_transfer_path(rank: int, world: int, tmp: str, attached: bool) -> None:
    shim_on_path()
    marker = Path(tmp) / "pause-marker"
    if rank == 0:
        marker.touch()  # disarmed
        os.environ[PAUSE_ENV], os.environ[MARKER_ENV] = ("8" if attached else "300"), str(marker)
    engine = start_receiver(tmp) if rank == 0 else None
    # A request would wait 120 s and retries would follow: only the watchdog can end the wait in time.
    cfg = sync_cfg(timeout_s=120.0, health_timeout_s=2.0)
    if attached and rank == 0:
        built, syncer = build_syncer(rank, cfg, None, url=engine.url, key=engine.api_key)
    else:
        built, syncer = build_syncer(rank, cfg, engine)
    try:
        syncer.sync(1)
        if rank == 0:
            _arm(marker)
        started = time.monotonic()
        syncer.sync(2)
        took = time.monotonic() - started
        adapter = expected_adapter(built)
        if rank == 0:
            assert syncer.watchdog.wedges == 1
            assert syncer.watchdog.last_wedge_s <= 2 * cfg.health_timeout_s, syncer.watchdog.last_wedge_s
            assert syncer.counters["engine_recoveries"] == 1 and syncer.versions.active.name == "policy-v2"
            if attached:  # waited for (its transfer path frees itself after 8 s), never killed
                assert engine.starts == 1 and took < 8 + 10, f"sync 2 took {took:.1f} s"
            else:  # killed and restarted well before the 120 s a request would have waited
                assert engine.starts == 2 and took < 30, f"sync 2 took {took:.1f} s"
            assert engine_adapters(syncer)[-1] == "policy-v2"
            assert engine_digest(syncer, "policy-v2") == digests(adapter)
    finally:
        syncer.close()
        if attached and engine is not None:
            engine.stop()


def test_an_embedded_engine_whose_transfer_path_wedges_behind_a_live_front_is_killed_and_restarted(
        tmp_path: Path) -> None:
    run_ranks(2, _wedged_transfer_path, str(tmp_path), False)


def test_an_attached_engine_whose_transfer_path_wedges_is_waited_for_and_fed_again(tmp_path: Path) -> None:
    run_ranks(2, _wedged_transfer_path, str(tmp_path), True)


