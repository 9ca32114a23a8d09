"""WeightSyncer on 2 gloo ranks against the real receiver process, which copies the bytes out and
holds them (its digests are the oracle): faults raise on every rank, a dead or restarted engine is
recovered (base, then the newest adapter), wrong acks publish nothing, live versions stay bounded."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from dist_helpers import run_ranks
from syncer_helpers import (
    build_syncer,
    engine_adapters,
    engine_digest,
    expected_adapter,
    expected_base,
    kill,
    shim_on_path,
    start_receiver,
    sync_cfg,
)

from titan_lora.lora.layer import adapter_params
from titan_lora.sync.parity import ParityProbe
from titan_lora.sync.syncer import EngineFailed, NonFiniteAdapterError
from titan_lora.transfer.errors import TransferError


def digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """SHA-256 per tensor: what the trainer means the engine to hold."""
    return {n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for n, t in tensors.items()}


def _receiver(rank: int, tmp: str, **kwargs):
    shim_on_path()
    return start_receiver(tmp, **kwargs) if rank == 0 else None


def _kill_mid_base_then_during_rollouts(rank: int, world: int, tmp: str) -> None:
    engine = _receiver(rank, tmp)
    built, syncer = build_syncer(rank, sync_cfg(), engine)
    try:
        if rank == 0:  # SIGKILL the engine when the first base transfer posts its 2nd bucket
            real, base_posts = syncer.emitter.client.post, []

            def post(path, body=None, timeout_s=None):
                if path == "/titan/bucket" and body["kind"] == "base" and engine.starts == 1:
                    base_posts.append(path)
                    if len(base_posts) == 2:
                        kill(engine)
                return real(path, body, timeout_s)

            syncer.emitter.client.post = post
        metrics = syncer.sync(1)
        base, adapter = expected_base(built), expected_adapter(built)
        if rank == 0:
            assert engine.starts == 2 and syncer.counters["engine_recoveries"] == 1
            assert syncer.counters["base_sends"] == 1, "only the resent base completed"
            assert metrics["sync/published"] == 1 and syncer.versions.live == [1]
            assert engine_adapters(syncer) == ["policy-v1"], "version 1 is installed exactly once"
            assert engine_digest(syncer, "policy-v1") == digests(adapter)
            assert engine_digest(syncer, "base") == digests(base)
            kill(engine)  # now during rollouts: with_engine restarts, sends the base and version 1
        served = syncer.with_engine(lambda: engine_adapters(syncer), "rollouts")
        if rank == 0:
            assert served == ["policy-v1"] and engine.starts == 3
            assert syncer.counters["base_sends"] == 2 and syncer.versions.active.name == "policy-v1"
            assert engine_digest(syncer, "policy-v1") == digests(adapter)
            os.kill(engine.proc.pid, signal.SIGSTOP)  # hung: alive, not serving
        else:
            assert served is None
        syncer.sync(2)  # the health check finds it hung within health_timeout_s: killed, restarted
        if rank == 0:
            assert engine.starts == 4 and syncer.counters["engine_recoveries"] == 3
            assert engine_adapters(syncer) == ["policy-v2"] and syncer.versions.live == [2]
            assert engine_digest(syncer, "policy-v2") == digests(adapter)
    finally:
        syncer.close()


def test_a_kill_mid_transfer_or_in_rollouts_and_a_hang_are_recovered_with_right_bytes(tmp_path: Path) -> None:
    run_ranks(2, _kill_mid_base_then_during_rollouts, str(tmp_path))


def _errors_raise_on_every_rank(rank: int, world: int, tmp: str) -> None:
    engine = _receiver(rank, tmp)
    built, syncer = build_syncer(rank, sync_cfg(), engine)
    try:
        syncer.sync(1)
        if rank == 0:  # the engine installs version 2 but acknowledges 4 bytes fewer
            real = syncer.emitter.send_adapter
            syncer.emitter.send_adapter = lambda p: dataclasses.replace(real(p), nbytes=real(p).nbytes - 4)
        with pytest.raises(TransferError, match=r"acknowledged adapter policy-v2 as version 2, \d+ tensors"):
            syncer.sync(2)
        if rank == 0:
            assert syncer.versions.active.name == "policy-v1" and syncer.versions.live == [1], "published"
            syncer.emitter.send_adapter = real
            real_post = syncer.emitter.client.post  # every bucket now names a segment that does not exist
            syncer.emitter.client.post = lambda path, body=None, timeout_s=None: real_post(
                path, {**body, "segment": {**body["segment"], "name": "titan-no-such-segment"}}
                if path == "/titan/bucket" else body, timeout_s)
        with pytest.raises(TransferError, match=r"sending adapter version 3.*HTTP"):
            syncer.sync(3)
        if rank == 0:
            assert syncer.versions.active.name == "policy-v1" and engine.starts == 1, "a healthy engine"
            kill(engine)
        syncer.cfg.engine_restarts = 0  # no recovery allowed: the dead engine ends the run, on every rank
        failed = r"rollouts: .* after 0 recoveries \(\[weight_sync\] engine_restarts\)"
        with pytest.raises(EngineFailed, match=failed):
            syncer.with_engine(lambda: engine_adapters(syncer), "rollouts")
    finally:
        syncer.close()


def test_an_engine_error_and_a_wrong_ack_raise_on_every_rank_and_publish_nothing(tmp_path: Path) -> None:
    run_ranks(2, _errors_raise_on_every_rank, str(tmp_path))


def _attached_engine_restarts(rank: int, world: int, tmp: str) -> None:
    engine = _receiver(rank, tmp, max_loras=2)
    url, key = (engine.url, engine.key) if engine else ("", "")  # a fresh key at each restart
    built, syncer = build_syncer(rank, sync_cfg(keep_versions=2), None, url, key)  # attached: not ours
    try:
        with pytest.raises(TransferError, match=r"keep_versions = 2 needs 3 adapter slots.*--max-loras >= 3"):
            syncer.check_engine()
        if rank == 0:
            engine.args = ["--max-loras", "3"]
            engine.restart()
        syncer.check_engine()
        syncer.sync(1)
        if rank == 0:
            engine.restart()  # out of band: a new incarnation with no base and no adapters
        syncer.sync(2)
        adapter, base = expected_adapter(built), expected_base(built)  # collective: every rank
        if rank == 0:
            # No question before the sync: the install's ack named the new incarnation, version 2 was
            # held back (not published), and the recovery sent the base, then version 2 again.
            assert syncer.counters["base_sends"] == 2 and syncer.counters["engine_recoveries"] == 1
            assert engine_adapters(syncer) == ["policy-v2"] and syncer.versions.live == [2]
            assert engine_digest(syncer, "policy-v2") == digests(adapter)
            assert engine_digest(syncer, "base") == digests(base), "the restarted engine got the base again"
            engine.restart()  # again, now under a rollout, which finds its adapter gone

        def rollout() -> list[str]:
            held = engine_adapters(syncer)
            if syncer.versions.active.name not in held:
                raise TransferError(f"HTTP 400: unknown adapter {syncer.versions.active.name}")
            return held

        served = syncer.with_engine(rollout, "rollouts")
        if rank == 0:
            assert served == ["policy-v2"] and syncer.counters["base_sends"] == 3
            assert engine_digest(syncer, "policy-v2") == digests(adapter)
            assert engine_digest(syncer, "base") == digests(base)
    finally:
        syncer.close()
        if engine is not None:
            engine.stop()


def test_an_attached_engine_that_restarts_gets_the_base_then_the_newest_adapter(tmp_path: Path) -> None:
    run_ranks(2, _attached_engine_restarts, str(tmp_path))


def _steady_state(rank: int, world: int, tmp: str, attached: bool) -> None:
    engine = _receiver(rank, tmp)
    url, key = (engine.url, engine.key) if engine and attached else ("", "")
    built, syncer = build_syncer(rank, sync_cfg(), None if attached else engine, url, key)
    from titan_lora.sync import collective

    messages, broadcasts, posts = [], [], []
    real_share, real_broadcast = collective.share, torch.distributed.broadcast
    collective.share = lambda value: messages.append(1) or real_share(value)
    torch.distributed.broadcast = lambda *a, **k: broadcasts.append(1) or real_broadcast(*a, **k)
    try:
        syncer.sync(1)  # the first sync asks for the incarnation and sends the base
        if rank == 0:
            real_post = syncer.emitter.client.post
            syncer.emitter.client.post = lambda path, body=None, timeout_s=None: posts.append(path) or \
                real_post(path, body, timeout_s)
            engine.check = lambda *a: pytest.fail("the health check runs only after a failure")
        messages.clear(), broadcasts.clear()
        for version in (2, 3, 4):
            metrics = syncer.sync(version)
            assert metrics["sync/version"] == version, "every rank learns the outcome"
            assert metrics.get("sync/published") == (1 if rank == 0 else None)  # rank 0 publishes
        assert len(messages) == 3, "one control message per sync: rank 0's outcome"
        assert len(broadcasts) == 3, "each in one broadcast"
        if rank == 0:
            on_path = [p for p in posts if p != "/titan/unload"]  # retirements run off the sync's path
            assert on_path == ["/titan/bucket"] * 3, posts  # the adapter's one bucket and its commit
            assert syncer.counters["base_sends"] == 1 and syncer.versions.active.name == "policy-v4"
            assert engine_digest(syncer, "policy-v4") == digests(expected_adapter(built))
    finally:
        collective.share, torch.distributed.broadcast = real_share, real_broadcast
        syncer.close()
        if engine is not None:
            engine.stop()


@pytest.mark.parametrize("attached", [False, True], ids=["embedded", "attached"])
def test_a_steady_state_sync_is_one_post_and_one_control_message(tmp_path: Path, attached: bool) -> None:
    run_ranks(2, _steady_state, str(tmp_path), attached)


def _live_versions_bounded(rank: int, world: int, tmp: str) -> None:
    engine = _receiver(rank, tmp)
    built, syncer = build_syncer(rank, sync_cfg(keep_versions=2), engine)
    try:
        if rank == 0:  # a slow engine-side unload: retirements lag behind the syncs
            real = syncer.retirer._unload
            syncer.retirer._unload = lambda name, t: (time.sleep(0.3), real(name, t))[1]
        for version in range(1, 8):
            syncer.sync(version)
            if rank == 0:
                assert len(syncer.versions.live) <= 3, syncer.versions.live
                assert len(engine_adapters(syncer)) <= 3, engine_adapters(syncer)
        if rank == 0:
            assert syncer.versions.active.name == "policy-v7" and "policy-v7" in engine_adapters(syncer)
    finally:
        syncer.close()


def test_live_versions_stay_within_keep_plus_one_without_waiting_for_retirements(tmp_path: Path) -> None:
    run_ranks(2, _live_versions_bounded, str(tmp_path))


def _nonfinite(rank: int, world: int, tmp: str) -> None:
    engine = _receiver(rank, tmp)
    built, syncer = build_syncer(rank, sync_cfg(), engine)
    try:
        syncer.sync(1)
        with torch.no_grad():  # every rank poisons its shard of one adapter tensor
            p = adapter_params(built.model)[0][1]
            (p.to_local() if hasattr(p, "to_local") else p).fill_(float("nan"))
        with pytest.raises(NonFiniteAdapterError, match=r"version 2 .*NaN.*\[training\] on_nonfinite"):
            syncer.sync(2)
        if rank == 0:
            assert engine_adapters(syncer) == ["policy-v1"] and syncer.versions.active.name == "policy-v1"
    finally:
        syncer.close()


def test_a_nonfinite_adapter_raises_on_every_rank_and_is_not_sent(tmp_path: Path) -> None:
    run_ranks(2, _nonfinite, str(tmp_path))


def _parity_gate(rank: int, world: int, tmp: str) -> None:
    engine = _receiver(rank, tmp)
    scores: list = []

    def score(sequences, adapter):
        scores.append(adapter)
        if adapter == "policy-v3":
            raise RuntimeError("the engine's scorer broke")
        return [[0.0] * (len(s) - 1) for s in sequences]  # |log p| of real tokens: far from 0

    cfg = sync_cfg(parity_every=1, parity_gate=True)
    built, syncer = build_syncer(rank, cfg, engine)
    syncer.probe = ParityProbe(built.model, [[1, 5, 9, 13, 17], [2, 4, 6]], torch.device("cpu"),
                               score if rank == 0 else None, tolerance=1e9)
    try:
        m1 = syncer.sync(1)
        syncer.probe.tolerance = 1e-3
        m2 = syncer.sync(2)
        if rank == 0:
            kill(engine)  # the engine restarts while version 2 (gated) holds the params
        held = syncer.with_engine(lambda: engine_adapters(syncer), "eval")
        if rank == 0:
            assert held == [] and syncer.versions.active is None, "a gated version is never served"
        syncer.probe.tolerance = 1e9
        m3 = syncer.sync(3)
        if rank == 0:
            assert m1["sync/published"] == 1 and m1["sync/parity_max_abs"] > 1e-3
            assert m2["sync/published"] == 0 and m2["sync/parity_gated"] == 1
            assert m2["sync/parity_max_abs"] == m1["sync/parity_max_abs"] or m2["sync/parity_max_abs"] > 1e-3
            assert m3["sync/published"] == 1 and m3["sync/probe_failures"] == 1, "a probe failure never stops"
            assert scores == ["policy-v1", "policy-v2", "policy-v3"]
            assert syncer.retirer.wait_idle(10)
            assert "policy-v2" not in engine_adapters(syncer), "a gated version is retired from the engine"
            assert syncer.versions.active.name == "policy-v3"
    finally:
        syncer.close()


def test_the_parity_gate_holds_a_bad_version_back_and_a_failed_probe_never_stops(tmp_path: Path) -> None:
    run_ranks(2, _parity_gate, str(tmp_path))
