"""N replicas behind one WeightSyncer (fan-out emitter, replica set, router), on the recording fakes of
inprocess_rig.py: every version to every live replica, quarantine of a failed or hung one with training
going on, its revival (its own base verified by digest, or the base sent by the next sync: rank 0 keeps no
copy), the newest version and rejoin, the base streamed to several replicas at once, and the router's
spread and pinning. The oracle is each fake's call log and the figures the fakes were given."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from inprocess_rig import BASE, Base, Emitter, Engine, Source, VerifyingEmitter, cfg
from syncer_helpers import shim_on_path
from wait_helpers import waited

from titan_lora.clients.base import Endpoint
from titan_lora.clients.fanout import FanoutEmitter
from titan_lora.clients.kinds import LaunchPlan
from titan_lora.clients.launch import EmbeddedEngine, start_engines
from titan_lora.clients.replica_set import NoLiveReplica, Replica, ReplicaSet
from titan_lora.clients.rollout import Completion
from titan_lora.clients.router import RolloutRouter
from titan_lora.sync.syncer import WeightSyncer
from titan_lora.sync.versions import AdapterVersions
from titan_lora.transfer.errors import EngineDied, EngineHung, EngineUnreachable


class Rollouts:
    """A rollout client that records (prompt count, adapter) and answers token [index of replica]."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.calls: list[tuple[int, str | None, int | None]] = []
        self.fail: BaseException | None = None
        self.interrupts: list[str] = []

    def generate(self, prompts, adapter, max_tokens, temperature, seed, stop_token_ids):
        self.calls.append((len(prompts), adapter, seed))
        if self.fail is not None:
            raise self.fail
        time.sleep(0.05)  # in flight long enough for the others to be routed past it
        return [Completion([self.index], "", [0.0]) for _ in prompts]

    def score(self, sequences, adapter):
        self.calls.append((len(sequences), adapter, None))
        return [[-1.0] for _ in sequences]

    def interrupt(self, reason: str) -> None:
        self.interrupts.append(reason)


def replica_set(n: int = 2, embedded: bool = False, **overrides) -> ReplicaSet:
    replicas = [Replica(i, Endpoint(f"http://127.0.0.1:{8000 + i}"), Emitter(), Rollouts(i),
                        Engine() if embedded else None) for i in range(n)]
    return ReplicaSet(replicas, cfg(**{"timeout_s": 5.0, **overrides}))


@pytest.fixture
def syncer_over():
    made: list[WeightSyncer] = []

    def make(replicas: ReplicaSet) -> WeightSyncer:
        versions = AdapterVersions("policy", 2)
        s = WeightSyncer(Source(), Base(), FanoutEmitter(replicas), replicas.cfg,
                         torch.device("cpu"), versions=versions, report=replicas.metrics)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def wait_until(predicate, what: str, timeout_s: float = 10.0) -> None:
    assert waited(predicate, timeout_s, poll_s=0.01), f"no {what} within {timeout_s} s"


def adapters(replica: Replica) -> list[str]:
    return [c for c in replica.emitter.calls if c.startswith(("adapter", "base"))]


def test_every_version_goes_to_every_replica_and_is_published_once_all_acked(syncer_over):
    rs = replica_set(2)
    syncer = syncer_over(rs)
    syncer.sync(1)
    metrics = syncer.sync(2)
    for r in rs.replicas:
        assert adapters(r) == ["base v1", "adapter policy-v1", "adapter policy-v2"]
        assert r.held == {1: "policy-v1", 2: "policy-v2"}
    assert syncer.versions.active.version == 2
    assert metrics["sync/live_replicas"] == 2.0
    assert metrics["sync/transfer_ms"] == 2.5  # the slowest replica's figure
    assert metrics["replica0/transfer_ms"] == metrics["replica1/transfer_ms"] == 2.5
    assert metrics["sync/base_sends"] == 1.0


def test_a_failed_replica_is_quarantined_then_rejoins_with_base_and_newest_version(syncer_over):
    rs = replica_set(2, embedded=True)
    syncer = syncer_over(rs)
    syncer.sync(1)
    bad = rs.replicas[1]
    bad.emitter.fail["adapter"] = [EngineDied("connection reset")]
    bad.engine.alive = False  # killed: its revival restarts it, and the new incarnation lacks our base
    bad.emitter.incarnation = "inc-2"
    gate = threading.Event()
    bad.engine.ensure_running = lambda: (gate.wait(10), bad.engine.events.append("restart"))
    metrics = syncer.sync(2)
    assert syncer.versions.active.version == 2, "published with the live replica's ack alone"
    assert (metrics["sync/live_replicas"], metrics["replica1/live"], metrics["replica1/quarantines"]) == (1, 0, 1)
    assert rs.live() == [rs.replicas[0]]
    syncer.sync(3)  # training does not wait for the revival
    assert "adapter policy-v3" not in bad.emitter.calls
    gate.set()
    wait_until(lambda: bad.awaiting_base, "the revival")  # its base cannot be verified (a plain emitter)
    assert "restart" in bad.engine.events and not bad.live
    syncer.sync(4)  # the next sync streams the base to it (rank 0 kept no copy), then it rejoins
    assert bad.live and not bad.awaiting_base and bad.rejoins == 1
    # the base, then the newest version it missed (v3, the revival's copy), then this sync's v4
    assert adapters(bad) == ["base v1", "adapter policy-v1", "adapter policy-v2", "base v4", "adapter policy-v3",
                             "adapter policy-v4"]
    assert syncer.counters["base_sends"] == 2
    assert adapters(rs.replicas[0])[-1] == "adapter policy-v4" and "base v4" not in rs.replicas[0].emitter.calls
    assert bad.held == {3: "policy-v3", 4: "policy-v4"} and rs.replicas[0].held.keys() >= {3, 4}


def test_a_wedged_replica_is_quarantined_within_its_health_timeout_and_its_request_ended(syncer_over):
    # timeout_s is long (a request would wait it out); only the liveness watch can end the wait in time.
    rs = replica_set(2, timeout_s=600.0, health_timeout_s=0.5)
    syncer = syncer_over(rs)
    syncer.sync(1)
    hung = rs.replicas[0]
    original = hung.emitter.send_adapter
    hung.emitter.wedged = True
    hung.emitter.send_adapter = lambda p: (hung.emitter.hang_until_interrupted() if hung.emitter.wedged
                                           else original(p))
    started = time.monotonic()
    syncer.sync(2)
    took = time.monotonic() - started
    assert took < 2 * 0.5 + 0.5, f"the sync waited {took:.2f} s on the wedged replica"
    assert not hung.live and syncer.versions.active.version == 2
    assert hung.emitter.interrupts and "failed its liveness check" in hung.emitter.interrupts[0]
    assert rs.replicas[1].held.keys() == {1, 2}
    hung.emitter.wedged = False  # it answers again: re-probed (same incarnation: no base), fed v2, live
    wait_until(lambda: hung.live, "rejoin")
    assert adapters(hung)[-1] == "adapter policy-v2" and adapters(hung).count("base v1") == 1


def test_a_version_every_replica_failed_is_not_published_until_a_revival_holds_it(syncer_over):
    # The revivals are held until the sync saw every replica fail: a version no engine held was published.
    rs = replica_set(2, embedded=True, health_timeout_s=0.2)  # the recovery polls every 0.2 s
    syncer = syncer_over(rs)
    syncer.sync(1)
    gate = threading.Event()
    for r in rs.replicas:
        r.emitter.fail["adapter"] = [EngineUnreachable("down")]
        r.engine.ensure_running = lambda r=r: (gate.wait(10), r.engine.events.append("restart"))
    published_while_none_live: list[int] = []
    publish = syncer.versions.publish

    def checked_publish(version: int) -> None:
        if not any(version in r.held for r in rs.live()):
            published_while_none_live.append(version)
        publish(version)

    syncer.versions.publish = checked_publish
    threading.Timer(0.5, gate.set).start()  # the recovery waits for a revival, then resends
    syncer.sync(2)
    assert published_while_none_live == []
    assert syncer.versions.active.version == 2 and syncer.counters["engine_recoveries"] == 1
    wait_until(lambda: len(rs.live()) == 2, "both back")
    assert all(r.held.get(2) == "policy-v2" for r in rs.replicas)


def test_a_set_whose_replicas_all_came_back_without_our_base_gets_it_from_the_next_sync(syncer_over):
    # Plain emitters cannot verify a base by digest: each revival waits for the syncer to stream it.
    rs = replica_set(2, embedded=True, engine_start_timeout_s=2.0)
    syncer = syncer_over(rs)
    syncer.sync(1)
    syncer.sync(2)
    for r in rs.replicas:
        r.emitter.incarnation = "inc-2"  # restarted: its own base is not ours
        rs.quarantine(r, "killed")
    wait_until(lambda: all(r.awaiting_base for r in rs.replicas), "both revivals")
    started = time.monotonic()
    syncer.sync(3)
    assert time.monotonic() - started < 1.0, "the sync waited for a live replica instead of sending the base"
    assert [r.live for r in rs.replicas] == [True, True] and syncer.versions.active.version == 3
    for r in rs.replicas:  # the base, the newest version the revival kept (v2), then this sync's v3
        assert adapters(r)[-3:] == ["base v3", "adapter policy-v2", "adapter policy-v3"]
        assert r.held.keys() >= {3}


def test_the_router_spreads_groups_by_outstanding_work_and_pins_versions():
    rs = replica_set(3)
    for r in rs.replicas[:2]:
        r.held = {1: "policy-v1"}
    rs.replicas[2].held = {0: "policy-v0"}  # behind: must get no policy-v1 request
    router = RolloutRouter(rs)
    prompts = [[p] for p in range(4) for _ in range(8)]  # 4 groups of 8
    out = router.generate(prompts, "policy-v1", 4, 1.0, 100, [])
    assert len(out) == 32
    counts = [sum(n for n, _, _ in r.rollouts.calls) for r in rs.replicas]
    assert counts == [16, 16, 0]
    seeds = sorted(s for r in rs.replicas for _, _, s in r.rollouts.calls)
    assert seeds == [100, 108, 116, 124], "each group keeps the seed it gets on one engine"
    metrics = rs.metrics()
    assert (metrics["replica0/samples"], metrics["replica1/samples"], metrics["replica2/samples"]) == (16, 16, 0)
    assert rs.metrics()["replica0/samples"] == 0, "counted per report"


def test_a_failed_request_quarantines_its_replica_and_goes_to_another():
    rs = replica_set(2)
    for r in rs.replicas:
        r.held = {1: "policy-v1"}
    rs.replicas[0].rollouts.fail = EngineUnreachable("connection refused")
    rs.replicas[0].emitter.fail["incarnation"] = [EngineUnreachable("down")] * 1000  # stays down
    router = RolloutRouter(rs)
    out = router.generate([[7]] * 4, "policy-v1", 4, 1.0, 0, [])
    assert [c.token_ids for c in out] == [[1]] * 4
    assert not rs.replicas[0].live
    with pytest.raises(NoLiveReplica, match="no live replica serves policy-v9"):
        router.score([[1, 2]], "policy-v9")
    rs.close()


def test_the_base_is_streamed_to_every_replica_at_once_and_no_copy_is_kept(syncer_over):
    rs = replica_set(3)
    base = Base()
    drawn_while_sending: list[int] = []
    for r in rs.replicas:  # each replica's emitter reads its queue as the stream goes; record how far it is
        original = r.emitter.send_base

        def send(tensors, version, original=original):
            got = []
            for item in tensors:
                drawn_while_sending.append(base.drawn - len(got))  # items drawn but not yet read by it
                got.append(item)
            return original(iter(got), version)

        r.emitter.send_base = send
    syncer = WeightSyncer(Source(), base, FanoutEmitter(rs), rs.cfg, torch.device("cpu"),
                          versions=AdapterVersions("policy", 2), report=rs.metrics)
    syncer.sync(1)
    assert base.starts == 1 and base.drawn == len(BASE), "one collective stream for all replicas"
    assert all(adapters(r)[0] == "base v1" for r in rs.replicas)
    assert max(drawn_while_sending) <= 3, "at most the queue's two tensors wait for a replica, plus its own"
    assert not hasattr(rs, "_base"), "rank 0 keeps no copy of the base"
    syncer.close()


def test_a_revived_replica_whose_own_base_has_our_digests_rejoins_without_a_base_send(syncer_over):
    record = {"dtype": "float32", "digests": {"model.embed_tokens.weight": "e", "model.norm.weight": "n"}}
    replicas = [Replica(i, Endpoint(f"http://127.0.0.1:{8000 + i}"), VerifyingEmitter(dict(record)), Rollouts(i),
                        Engine()) for i in range(2)]
    rs = ReplicaSet(replicas, cfg(timeout_s=5.0))
    syncer = WeightSyncer(Source(), Base(), FanoutEmitter(rs), rs.cfg, torch.device("cpu"),
                          versions=AdapterVersions("policy", 2), report=rs.metrics,
                          base_digests=lambda dtype: dict(record["digests"]))
    syncer.sync(1)
    assert syncer.counters["base_verified"] == 1 and syncer.counters["base_sends"] == 0
    bad = rs.replicas[1]
    bad.emitter.fail["adapter"] = [EngineDied("connection reset")]
    bad.emitter.incarnation = "inc-2"  # restarted: it loaded the checkpoint again
    syncer.sync(2)
    wait_until(lambda: bad.live, "rejoin")  # verified by its revival alone: no sync needed
    assert [c for c in bad.emitter.calls if c.startswith(("adopt", "base", "adapter"))] == [
        "adopt v1", "adapter policy-v1", "adapter policy-v2", "adopt v1", "adapter policy-v2"]  # v2 failed once
    assert syncer.counters["base_sends"] == 0 and not bad.awaiting_base
    bad.emitter.incarnation, bad.emitter.record = "inc-3", {"dtype": "float32", "digests": {}}  # dummy weights
    rs.quarantine(bad, "killed again")
    wait_until(lambda: bad.awaiting_base, "the revival")
    syncer.sync(3)  # the next sync streams the whole base to it alone
    assert bad.live and "base v3" in bad.emitter.calls and "base v3" not in rs.replicas[0].emitter.calls
    syncer.close()


@pytest.mark.parametrize("then", ["adopt", "send the part that differs"])
def test_one_base_step_asks_each_replica_its_incarnation_once(then: str) -> None:
    record = {"dtype": "float32", "digests": {"model.embed_tokens.weight": "e", "model.norm.weight": "n"}}
    replicas = [Replica(i, Endpoint(f"http://127.0.0.1:{8000 + i}"), VerifyingEmitter(dict(record)), Rollouts(i),
                        None) for i in range(2)]
    rs = ReplicaSet(replicas, cfg(timeout_s=5.0))
    fan = FanoutEmitter(rs)
    try:
        for r in replicas:
            rs.based(r, "inc-1")
        replicas[1].emitter.incarnation = "inc-2"  # came back as a new incarnation: it alone lacks our base
        assert fan.base_digests() == record
        if then == "adopt":
            fan.adopt_base(3)
        else:
            fan.send_base_part(Base()(), 3)
        assert replicas[0].emitter.calls == ["incarnation"], "asked once whether it lacks the base, and left alone"
        # Replica 1: once to find that it lacks the base, once to record the incarnation that took it.
        taken = "adopt v3" if then == "adopt" else "base part v3: ['model.embed_tokens.weight', 'model.norm.weight']"
        assert replicas[1].emitter.calls == ["incarnation", "digests", taken, "incarnation"]
        assert replicas[1].base_incarnation == "inc-2"
    finally:
        fan.close()


def test_engines_started_from_short_lived_threads_outlive_them(tmp_path):
    """PR_SET_PDEATHSIG follows the forking *thread*: before the spawner thread, both receivers got SIGTERM
    as start_engines' threads returned (and a revived replica as its revival thread did)."""
    shim_on_path()
    engines = [EmbeddedEngine(LaunchPlan("receiver_shim", []), 0, str(tmp_path / f"engine{i}.log"),
                              start_timeout_s=60,
                              health_timeout_s=2.0) for i in range(2)]
    try:
        start_engines(engines)
        revived = threading.Thread(target=engines[1].restart)
        revived.start()
        revived.join()
        time.sleep(1.0)
        assert [e.healthy() for e in engines] == [True, True]
        assert engines[1].starts == 2
    finally:
        for e in engines:
            e.stop()


def test_rollouts_in_flight_on_a_wedged_replica_go_to_the_others_within_its_health_timeout():
    rs = replica_set(2, health_timeout_s=0.5)
    for r in rs.replicas:
        r.held = {1: "policy-v1"}
    frozen, ended = rs.replicas[0], threading.Event()
    frozen.emitter.wedged = True

    def hang(prompts, adapter, max_tokens, temperature, seed, stop_token_ids):
        frozen.rollouts.calls.append((len(prompts), adapter, seed))
        assert ended.wait(30), "the request to the wedged replica was never ended"
        raise EngineHung("abandoned: interrupted")

    frozen.rollouts.generate = hang
    frozen.rollouts.interrupt = lambda reason: (frozen.rollouts.interrupts.append(reason), ended.set())
    router = RolloutRouter(rs)
    started = time.monotonic()
    out = router.generate([[7]] * 4 + [[8]] * 4, "policy-v1", 4, 1.0, 0, [])
    took = time.monotonic() - started
    assert [c.token_ids for c in out] == [[1]] * 8, "every group served by the live replica"
    assert took < 2 * 0.5 + 0.5, f"the step waited {took:.2f} s on the wedged replica"
    assert not frozen.live and "failed its liveness check" in frozen.rollouts.interrupts[0]
    assert [r.outstanding for r in rs.replicas] == [0, 0], "work given back on both replicas"
    rs.close()


def test_the_least_loaded_choice_counts_work_given_back():
    # A count that never falls (outstanding -= 0 in done) would route everything to one replica.
    rs = replica_set(2)
    first = rs.pick(None, 10, exclude=set())
    rs.done(first, 10)
    second = rs.pick(None, 1, exclude=set())
    assert (first.index, second.index) == (0, 1)
    third = rs.pick(None, 1, exclude=set())  # replica 0 is idle again, replica 1 has 1 in flight
    assert third.index == 0 and [r.outstanding for r in rs.replicas] == [1, 1]
    rs.done(second, 1)
    rs.done(third, 1)
    assert [r.outstanding for r in rs.replicas] == [0, 0]
    rs.close()


def test_a_base_send_longer_than_one_request_timeout_quarantines_no_replica(syncer_over):
    # Every bucket answers within timeout_s, the whole send takes longer: one engine would finish it.
    rs = replica_set(2, timeout_s=0.2)
    for r in rs.replicas:
        original = r.emitter.send_base
        r.emitter.send_base = lambda tensors, version, original=original: (
            time.sleep(0.6), original(tensors, version))[1]
    syncer = syncer_over(rs)
    syncer.sync(1)
    assert [r.live for r in rs.replicas] == [True, True] and [r.quarantines for r in rs.replicas] == [0, 0]
    assert syncer.versions.active.version == 1


def test_a_tensor_one_replica_holds_otherwise_is_sent_to_the_replicas_lacking_our_base():
    # Replica 0's own base has our digests, replica 1's norm differs: one replica's match must not hide it.
    ours = {"model.embed_tokens.weight": "e", "model.norm.weight": "n"}
    records = [{"dtype": "float32", "digests": dict(ours)},
               {"dtype": "float32", "digests": {**ours, "model.norm.weight": "other"}}]
    replicas = [Replica(i, Endpoint(f"http://127.0.0.1:{8000 + i}"), VerifyingEmitter(rec), Rollouts(i), None)
                for i, rec in enumerate(records)]
    rs = ReplicaSet(replicas, cfg(timeout_s=5.0))
    syncer = WeightSyncer(Source(), Base(), FanoutEmitter(rs), rs.cfg, torch.device("cpu"),
                          versions=AdapterVersions("policy", 2), base_digests=lambda dtype: dict(ours))
    try:
        syncer.sync(1)
        for r in replicas:
            assert "base part v1: ['model.norm.weight']" in r.emitter.calls, r.emitter.calls
        assert syncer.counters["base_sends"] == 1 and syncer.counters["base_verified"] == 0
    finally:
        syncer.close()
