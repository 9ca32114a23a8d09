"""The emitter over N replicas: each base and adapter version goes to every live replica at once.

To the syncer it is one engine. A call returns when every live replica acknowledged (version, tensor
count, bytes, and each bucket's checksum inside the replica's own emitter) or failed; a replica that
fails, acks other figures, lets one request go past `[weight_sync] timeout_s` or fails its liveness check
meanwhile (`ReplicaSet`: its requests then end at once) is quarantined
(`ReplicaSet`), and the call returns with the others' acks: the syncer then publishes the version, so
it is published when every live replica holds it. When none acknowledged and no replica is left live it
raises (`NoLiveReplica`, an engine fault: the syncer's bounded recovery waits for a revival), so a version
is never published with no replica holding it. A set whose replicas all came back without our base still
answers for its incarnation: the next sync (or the recovery) sends them the base, which they wait for.

All replicas read the gather's buffer in place when they share its transport (the same shared-memory
segment, or the same tcp server); a replica on another transport gets the payload packed into its own
emitter's buffers. The base is streamed to every replica that needs it at once, each taking the tensors from
a queue of two: rank 0 holds no copy of it (`_stream`). Replicas that load the checkpoint themselves are
verified by digest instead (`base_digests`, `adopt_base`, `send_base_part`: the syncer's `_give_base`), and
so is a revived one (`ReplicaSet`); one whose base differs waits for the next sync, which sends it.
"""

from __future__ import annotations

import dataclasses
import queue
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait

import torch

from titan_lora.clients.base import AdapterPayload, BaseTensors, VerifiesBase, base_items, verify_ack
from titan_lora.clients.replica_set import NoLiveReplica, Replica, ReplicaSet
from titan_lora.transfer.errors import TransferError
from titan_lora.transfer.protocol import Ack, EngineLimits
from titan_lora.transfer.transport import BucketBuffer


def combined_limits(limits: list[EngineLimits]) -> EngineLimits:
    """What every replica can serve: the smallest rank and slot count, the common target modules, expert LoRA
    where every replica that says serves it."""
    targets = [lim.target_modules for lim in limits if lim.target_modules is not None]
    common = frozenset.intersection(*targets) if targets else None
    said = [lim.expert_lora for lim in limits if lim.expert_lora is not None]
    return EngineLimits(min(lim.max_lora_rank for lim in limits), min(lim.max_loras for lim in limits), common,
                        all(said) if said else None)


def slowest(acks: list[Ack]) -> dict[str, float]:
    """Per phase, the largest figure over the replicas' acks (the fan-out waits for the slowest)."""
    phases: dict[str, float] = {}
    for ack in acks:
        for key, value in ack.phases_ms.items():
            phases[key] = max(phases.get(key, value), value)
    return phases


class _Feed:
    """One replica's share of a streamed base: a queue of at most two tensors, ended by None."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=2)

    def put(self, item: tuple | None, call: Future) -> None:
        """Queue `item` unless the replica's call ended (it failed: nobody reads any more)."""
        while not call.done():
            try:
                self._queue.put(item, timeout=0.05)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Iterator:
        while (item := self._queue.get()) is not None:
            yield item


class FanoutEmitter:
    """An `Emitter` that sends to every live replica of `replicas` concurrently (rank 0)."""

    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas
        n = len(replicas.replicas)
        # Twice the replicas: a call stuck on a hung replica holds a worker until its own timeout.
        self._pool = ThreadPoolExecutor(max_workers=2 * n, thread_name_prefix="titan-fanout")
        self._incarnation = f"replicas-{uuid.uuid4().hex}"
        # The targets `base_digests` found, for the adopt or send of the same base step (then dropped): the
        # replicas verified are the ones given the base, and each is asked its incarnation once a step.
        self._step_targets: list[Replica] | None = None

    def engine_limits(self) -> EngineLimits:
        """The limits every replica meets (each is asked; an unreachable one fails the start-up)."""
        return combined_limits([r.emitter.engine_limits() for r in self.replicas.replicas])

    def engine_incarnation(self) -> str:
        """One id for the whole set while any replica is live or waits for our base: a replica's own restart
        is its revival's business (it verifies its base, or waits for the next sync: `waiting_for_base`),
        not the syncer's; when all wait, the syncer must reach the set to send them the base."""
        if not self.replicas.live() and not self.replicas.awaiting():
            raise NoLiveReplica(f"none of the {len(self.replicas.replicas)} replicas is live or waits for "
                                "the base; their revivals run in the background")
        return self._incarnation

    def check_live(self, timeout_s: float) -> None:
        """Pass while any replica is live or waits for the base: each one's liveness is the replica set's
        watch."""
        self.engine_incarnation()

    def interrupt(self, reason: str) -> None:
        """End the requests in flight on every replica."""
        self.replicas.each(lambda r: r.interrupt(reason))

    def lend_buffer(self, numel: int, dtype: torch.dtype, device: torch.device,
                    ) -> tuple[torch.Tensor, BucketBuffer | None]:
        """Replica 0's transport buffer: every replica on the same transport reads the adapter from it."""
        return self.replicas.replicas[0].emitter.lend_buffer(numel, dtype, device)

    def _for(self, replica: Replica, payload: AdapterPayload) -> AdapterPayload:
        """The payload as `replica` can read it: in place when it shares the lender's transport."""
        if payload.home is None or replica.endpoint.transport == self.replicas.replicas[0].endpoint.transport:
            return payload
        return dataclasses.replace(payload, home=None)

    def _fan(self, targets: list[Replica], call: Callable[[Replica], Ack], check: Callable[[Ack], None],
             what: str, pump: Callable[[dict], None] | None = None) -> list[tuple[Replica, Ack]]:
        """`call` on every target at once; the ones that fail or fail `check` are quarantined (a revived one
        waiting for the base is revived again). No bound on the whole call: each request has its own
        (`timeout_s`), and a replica that hangs meanwhile is quarantined by the replica set's watch, which
        ends its requests. `pump(futures)` runs in this thread meanwhile (feeding a stream). Raises
        NoLiveReplica when targets were given, none acknowledged and no replica is live: a live one not
        targeted holds what was sent already (and a revival rejoins only with the newest adapter)."""
        def timed(replica: Replica) -> tuple[Ack, float]:
            started = time.perf_counter()
            return call(replica), (time.perf_counter() - started) * 1e3

        futures = {}
        for replica in targets:
            replica.busy = futures[replica] = self._pool.submit(timed, replica)
        if pump is not None:
            pump(futures)
        futures_wait(list(futures.values()))
        acked, failures = [], []
        for replica, future in futures.items():
            try:
                ack, total_ms = future.result()
                check(ack)
            except Exception as err:  # noqa: BLE001 (a failed replica is quarantined; the others go on)
                failures.append(f"{replica}: {err}")
                if replica.awaiting_base:  # not live: its revival starts over
                    self.replicas.revive_again(replica, f"{what} failed: {err}")
                else:
                    self.replicas.quarantine(replica, f"{what} failed: {err}")
                continue
            replica.phases = {**ack.phases_ms, "total_ms": total_ms}
            acked.append((replica, ack))
        if targets and not acked and not self.replicas.live():
            raise NoLiveReplica(f"{what}: no replica acknowledged it and none is live; "
                                + "; ".join(failures))
        return acked

    def _live_or_raise(self, what: str) -> list[Replica]:
        live = self.replicas.live()
        if not live:
            raise NoLiveReplica(f"{what}: none of the {len(self.replicas.replicas)} replicas is live")
        return live

    def _lacks_base(self, replica: Replica) -> bool:
        """Whether `replica`'s incarnation lacks our base; one that does not answer is quarantined."""
        if replica.base_incarnation is None:
            return True
        try:
            return replica.emitter.engine_incarnation() != replica.base_incarnation
        except TransferError as err:
            self.replicas.quarantine(replica, f"it did not answer before the base: {err}")
            return False

    # ---- the base ----------------------------------------------------------------------------------
    def waiting_for_base(self) -> bool:
        """Whether a revived replica waits for the base from the next sync (rank 0, no request)."""
        return bool(self.replicas.awaiting())

    def _base_targets(self, what: str) -> list[Replica]:
        """The replicas that lack our base: the revived ones waiting for it, and live ones of a new
        incarnation (at start-up: all). Found once a base step: the adopt or send that follows
        `base_digests` takes the replicas it read."""
        targets, self._step_targets = self._step_targets, None
        if targets is not None:  # less any quarantined since (their revival owns them now)
            return [r for r in targets if r.live or r.awaiting_base]
        waiting = self.replicas.awaiting()
        live = self._live_or_raise(what) if not waiting else self.replicas.live()
        return waiting + [r for r in live if self._lacks_base(r)]

    def base_digests(self) -> dict[str, Any]:
        """The record common to the replicas that lack our base: a digest where they all agree (others
        count as differing); no digests when one loaded no checkpoint or they hold other dtypes."""
        self._step_targets = None  # a new base step
        targets = self._base_targets("reading the replicas' base digests")
        records = [r.emitter.base_digests() if isinstance(r.emitter, VerifiesBase) else {"dtype": None, "digests": {}}
                   for r in targets]
        self._step_targets = targets
        if not records or any(not rec["digests"] or rec["dtype"] != records[0]["dtype"] for rec in records):
            return {"dtype": None, "digests": {}}
        first = records[0]["digests"]
        return {"dtype": records[0]["dtype"],
                "digests": {n: d for n, d in first.items() if all(rec["digests"].get(n) == d for rec in records)}}

    def remember_base_digests(self, ours: dict[str, Any], version: int) -> None:
        """Keep the trainer's digests: a revived replica's own base is verified with them."""
        self.replicas.remember_base(ours, version)

    def adopt_base(self, version: int) -> None:
        """Every replica lacking our base holds it (the syncer compared their digests): record it."""
        targets = self._base_targets("recording the verified base")

        def adopt(replica: Replica) -> Ack:
            replica.emitter.adopt_base(version)
            self.replicas.based(replica, replica.emitter.engine_incarnation())
            return Ack(version, 0, 0)

        self._rejoin(self._fan(targets, adopt, lambda _: None, "recording the verified base"))

    def send_base(self, tensors: BaseTensors, version: int) -> Ack:
        """Stream the whole base to every replica that lacks it at once; rank 0 keeps no copy."""
        return self._send(tensors, version, lambda r, items: r.emitter.send_base(items, version))

    def send_base_part(self, tensors: BaseTensors, version: int) -> Ack:
        """Stream the tensors whose digests differed to every replica that lacks our base; each reads the
        rest from its own checkpoint."""
        return self._send(tensors, version, lambda r, items: r.emitter.send_base_part(items, version))

    def _send(self, tensors: BaseTensors, version: int, send: Callable[[Replica, Iterator], Ack]) -> Ack:
        targets = self._base_targets("sending the base")
        feeds = {r: _Feed() for r in targets}
        sent = {"tensors": 0, "bytes": 0}
        incarnations: dict[int, str] = {}

        def call(replica: Replica) -> Ack:
            ack = send(replica, iter(feeds[replica]))
            incarnations[replica.index] = replica.emitter.engine_incarnation()
            return ack

        def check(ack: Ack) -> None:
            verify_ack(ack, version, sent["tensors"], sent["bytes"], "base weights")

        acked = self._fan(targets, call, check, "sending the base",
                          pump=lambda futures: _stream(base_items(tensors), feeds, futures, sent))
        for replica, _ in acked:
            self.replicas.based(replica, incarnations[replica.index])
        self._rejoin(acked)
        return Ack(version, sent["tensors"], sent["bytes"], slowest([ack for _, ack in acked]))

    def _rejoin(self, acked: list[tuple[Replica, Ack]]) -> None:
        """A revived replica that now holds our base rejoins with the newest adapter version (one that
        failed to take it was revived again by `_fan`; the sync goes on with the others)."""
        for replica, _ in acked:
            if replica.awaiting_base:
                self.replicas.rejoin(replica)

    def send_adapter(self, payload: AdapterPayload) -> Ack:
        """Send `payload` to every live replica that lacks it, at once; quarantine the ones that fail."""
        self.replicas.keep_latest(payload)  # before the sends: a replica failing now is revived onto it
        live = self._live_or_raise(f"sending adapter {payload.name}")
        targets = [r for r in live if payload.version not in r.held]

        def check(ack: Ack) -> None:
            verify_ack(ack, payload.version, payload.num_tensors, payload.nbytes, f"adapter {payload.name}")

        acked = self._fan(targets, lambda r: r.emitter.send_adapter(self._for(r, payload)), check,
                          f"sending adapter {payload.name}")
        for replica, _ in acked:
            self.replicas.holds(replica, payload)
        return Ack(payload.version, payload.num_tensors, payload.nbytes, slowest([ack for _, ack in acked]))

    def retire_adapter(self, name: str, timeout_s: float) -> bool:
        """Unload `name` from every live replica holding it, at once; True when all did in time."""
        holders = [(r, v) for r in self.replicas.live() for v, n in list(r.held.items()) if n == name]
        futures = [(r, v, self._pool.submit(r.emitter.retire_adapter, name, timeout_s)) for r, v in holders]
        unloaded = True
        for replica, version, future in futures:
            try:
                ok = future.result()
            except TransferError:
                ok = False
            if ok:
                self.replicas.forget(replica, version)
            unloaded = unloaded and ok
        return unloaded

    def close(self) -> None:
        """Stop the replicas (revivals, engines, emitters), then the fan-out threads."""
        self.replicas.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _stream(items: Iterator, feeds: dict[Replica, _Feed], futures: dict[Replica, Future], sent: dict) -> None:
    """Feed every tensor of `items` to each target's queue (at most two waiting in each: no copy of the
    base is held); a target whose call ended (failed) is skipped. Every item is drawn: the stream is
    collective on the trainer's side."""
    for name, tensor in items:
        sent["tensors"] += 1
        sent["bytes"] += tensor.numel() * tensor.element_size()
        for replica, feed in feeds.items():
            feed.put((name, tensor), futures[replica])
    for replica, feed in feeds.items():
        feed.put(None, futures[replica])
