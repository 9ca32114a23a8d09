"""The emitter over N replicas: each base and adapter version goes to every live replica at once.

To the syncer it is one engine. A call returns when every live replica acknowledged (version, tensor
count, bytes, and each bucket's checksum inside the replica's own emitter) or failed; a replica that
fails, acks other figures, lets one request go past `[weight_sync] timeout_s` or fails its liveness check
meanwhile (`ReplicaSet`: its requests then end at once) is quarantined
(`ReplicaSet`), and the call returns with the others' acks: the syncer then publishes the version, so
it is published when every live replica holds it. Only when no replica is left does it raise
(`NoLiveReplica`, an engine fault: the syncer's bounded recovery waits for a revival).

All replicas read the gather's buffer in place when they share its transport (the same shared-memory
segment, or the same tcp server); a replica on another transport gets the payload packed into its own
emitter's buffers.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait

import torch

from titan_lora.clients.base import AdapterPayload, BaseTensors, verify_ack
from titan_lora.clients.replica_set import NoLiveReplica, Replica, ReplicaSet
from titan_lora.transfer.errors import TransferError
from titan_lora.transfer.protocol import Ack, EngineLimits
from titan_lora.transfer.transport import BucketBuffer


def combined_limits(limits: list[EngineLimits]) -> EngineLimits:
    """What every replica can serve: the smallest rank and slot count, the common target modules."""
    targets = [lim.target_modules for lim in limits if lim.target_modules is not None]
    common = frozenset.intersection(*targets) if targets else None
    return EngineLimits(min(lim.max_lora_rank for lim in limits), min(lim.max_loras for lim in limits), common)


def slowest(acks: list[Ack]) -> dict[str, float]:
    """Per phase, the largest figure over the replicas' acks (the fan-out waits for the slowest)."""
    phases: dict[str, float] = {}
    for ack in acks:
        for key, value in ack.phases_ms.items():
            phases[key] = max(phases.get(key, value), value)
    return phases


class FanoutEmitter:
    """An `Emitter` that sends to every live replica of `replicas` concurrently (rank 0)."""

    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas
        n = len(replicas.replicas)
        # Twice the replicas: a call stuck on a hung replica holds a worker until its own timeout.
        self._pool = ThreadPoolExecutor(max_workers=2 * n, thread_name_prefix="titan-fanout")
        self._incarnation = f"replicas-{uuid.uuid4().hex}"

    def engine_limits(self) -> EngineLimits:
        """The limits every replica meets (each is asked; an unreachable one fails the start-up)."""
        return combined_limits([r.emitter.engine_limits() for r in self.replicas.replicas])

    def engine_incarnation(self) -> str:
        """One id for the whole set while any replica is live: a replica's own restart is its revival's
        business (it re-feeds the base from the host copy), not the syncer's."""
        if not self.replicas.live():
            raise NoLiveReplica(f"none of the {len(self.replicas.replicas)} replicas is live; their revivals "
                                "run in the background")
        return self._incarnation

    def check_live(self, timeout_s: float) -> None:
        """Pass while any replica is live: each one's liveness is the replica set's watch."""
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
             what: str) -> list[tuple[Replica, Ack]]:
        """`call` on every target at once; the ones that fail or fail `check` are quarantined. No bound on
        the whole call: each request has its own (`timeout_s`), and a replica that hangs meanwhile is
        quarantined by the replica set's watch, which ends its requests. Raises NoLiveReplica when
        targets were given and none acknowledged."""
        def timed(replica: Replica) -> tuple[Ack, float]:
            started = time.perf_counter()
            return call(replica), (time.perf_counter() - started) * 1e3

        futures = {}
        for replica in targets:
            replica.busy = futures[replica] = self._pool.submit(timed, replica)
        futures_wait(list(futures.values()))
        acked, failures = [], []
        for replica, future in futures.items():
            try:
                ack, total_ms = future.result()
                check(ack)
            except Exception as err:  # noqa: BLE001 (a failed replica is quarantined; the others go on)
                failures.append(f"{replica}: {err}")
                self.replicas.quarantine(replica, f"{what} failed: {err}")
                continue
            replica.phases = {**ack.phases_ms, "total_ms": total_ms}
            acked.append((replica, ack))
        if targets and not acked:
            raise NoLiveReplica(f"{what}: no replica acknowledged it; " + "; ".join(failures))
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

    def send_base(self, tensors: BaseTensors, version: int) -> Ack:
        """Keep a host copy of the base, then send it to every live replica whose incarnation lacks it."""
        kept, count, nbytes = self.replicas.keep_base(tensors, version)
        targets = [r for r in self._live_or_raise("sending the base") if self._lacks_base(r)]

        def check(ack: Ack) -> None:
            verify_ack(ack, version, count, nbytes, "base weights")

        incarnations: dict[int, str] = {}

        def send(replica: Replica) -> Ack:
            ack = replica.emitter.send_base(kept, version)
            incarnations[replica.index] = replica.emitter.engine_incarnation()
            return ack

        acked = self._fan(targets, send, check, "sending the base")
        for replica, _ in acked:
            self.replicas.based(replica, incarnations[replica.index])
        return Ack(version, count, nbytes, slowest([ack for _, ack in acked]))

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
