"""The vLLM bucket emitter: adapter (and base) tensors in double-buffered buckets, acked per bucket.

Bucket k is packed into buffer k % 2 while bucket k-1 is being copied out by the engine; a buffer is
packed again only after the engine acknowledged that it copied the bucket it held (the overwrite
race of verl #5934 cannot happen). A bucket whose tensors already lie in the shared buffer the payload
names (the gatherer writes the adapter into one this emitter lent it, `lend_buffer`) goes as it is, with no
packing copy: that buffer is written again only by the next gather, after this transfer is acknowledged.
The adapter's commit rides on its last bucket. Every bucket carries the checksum of its bytes as sent
(`buckets.bucket_checksum`); the engine acks the checksum of the copy it holds, and any difference fails
the transfer. The base is packed as its tensors arrive (a generator whose every step may run a
collective), so rank 0 holds at most two buckets of it. The engine side is `titan_lora.engines.vllm_ext`.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
import types
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any, TypeVar

import torch

from titan_lora.clients.base import AdapterPayload, AdapterSet, BaseTensors, Endpoint, base_items, bucket_route, log_route
from titan_lora.clients.http import JsonClient
from titan_lora.clients.kinds import EngineKind, LaunchPlan, LaunchRequest
from titan_lora.config import Engine, WeightSync
from titan_lora.transfer import protocol
from titan_lora.transfer.buckets import (
    Entry,
    bucket_checksum,
    bucket_size,
    entry_for,
    layout_id,
    next_offset,
    one_run,
    pack,
    pack_one,
    plan_buckets,
)
from titan_lora.transfer.errors import LayoutUnknownToEngine, TransferError
from titan_lora.transfer.protocol import Ack, EngineLimits
from titan_lora.transfer.transport import BucketBuffer, TransportChoice, lend_buffer, make_buffers, offset_in

T = TypeVar("T")


def _completed(fn: Callable[..., T], *args: object) -> Future:
    """`fn(*args)` run now, as a finished future (its result, or the exception it raised)."""
    future: Future = Future()
    try:
        future.set_result(fn(*args))
    except Exception as err:  # noqa: BLE001 (raised again by result(), where pool posts raise theirs)
        future.set_exception(err)
    return future


@dataclasses.dataclass(frozen=True)
class _PlannedBucket:
    entries: list[Entry]
    run: torch.Tensor | None  # the bucket's bytes as one view of the source, when they are contiguous
    layout: str
    size: int
    home: tuple[BucketBuffer, int] | None  # (shared buffer, offset) when the run already lies in one


@dataclasses.dataclass(frozen=True)
class _Posted:
    """One bucket on its way: where its bytes lie, and the checksum of those bytes as sent."""

    index: int
    entries: list[Entry]
    layout: str
    buf: BucketBuffer
    offset: int
    checksum: str


@dataclasses.dataclass
class _Streamed:
    """What the engine acknowledged of one transfer."""

    transfer_id: str
    tensors: int = 0
    bytes: int = 0
    commit: dict | None = None
    phases: dict[str, float] = dataclasses.field(default_factory=dict)

    def add(self, ack: dict) -> None:
        self.tensors += ack["tensors"]
        self.bytes += ack["bytes"]
        self.commit = ack.get("commit", self.commit)


class _Transfer:
    """The bucket posts of one transfer, in order on the emitter's post thread (a lone bucket: the caller's).

    A packing buffer is handed out again only after the engine acknowledged the bucket it held; after a
    failed post, later posts (and the commit riding on the last one) are not sent.
    """

    def __init__(self, emitter: VLLMBucketEmitter, kind: str) -> None:
        self.emitter = emitter
        self.kind = kind
        self.id = uuid.uuid4().hex
        self.failed = threading.Event()
        self.posts: list[Future] = []
        self._slot_posts: list[Future | None] = [None, None]  # the last post from each packing buffer
        self._next_slot = 0
        self.started = time.perf_counter()
        self.pack_s = self.checksum_s = 0.0

    def take_slot(self) -> int:
        """The next packing buffer, once the engine copied out the bucket it held."""
        slot, self._next_slot = self._next_slot, 1 - self._next_slot
        if self._slot_posts[slot] is not None:
            self._slot_posts[slot].result()
        return slot

    def drain(self) -> None:
        """Wait until no post reads a packing buffer (before the buffers are replaced)."""
        for post in self._slot_posts:
            if post is not None:
                post.result()

    def post(self, entries: list[Entry], buf: BucketBuffer, offset: int, *, layout: str | None = None,
             slot: int | None = None, commit: dict | None = None, inline: bool = False,
             checksum: str | None = None) -> None:
        """Queue one bucket whose bytes start `offset` bytes into `buf` (`slot`: its packing buffer);
        `inline`: post it from this thread (a lone bucket has nothing to overlap with); `checksum`: of
        those bytes, when the caller already read it (that read waited for the bytes)."""
        if checksum is None:
            buf.synchronize()
            t0 = time.perf_counter()
            # A base bucket's (address, size) seldom recurs: a graph would cost more than it saves.
            checksum = bucket_checksum(buf.tensor[offset : offset + bucket_size(entries)],
                                       graphed=self.kind == "adapter")
            self.checksum_s += time.perf_counter() - t0
        bucket = _Posted(len(self.posts), entries, layout or layout_id(entries), buf, offset, checksum)
        if inline:  # two thread hand-offs less: each wake of a sleeping thread costs ~0.1 ms on a sync's path
            self.posts.append(_completed(self.emitter._post_bucket, self, bucket, commit))
        else:
            self.posts.append(self.emitter._pool.submit(self.emitter._post_bucket, self, bucket, commit))
        if slot is not None:
            self._slot_posts[slot] = self.posts[-1]

    def finish(self) -> _Streamed:
        """Every ack, in order (the last one carries the commit), and the phase times."""
        out = _Streamed(self.id)
        copy_ms = 0.0
        for post in self.posts:
            ack = post.result()
            out.add(ack)
            copy_ms += float(ack.get("copy_ms", 0.0))
        total_ms = (time.perf_counter() - self.started) * 1e3
        pack_ms, checksum_ms = self.pack_s * 1e3, self.checksum_s * 1e3
        # transfer: the rest of the wall time (posts, waits for the engine's acks and, for a streamed base,
        # drawing the stream), so that the three add up to it.
        out.phases = {"pack_ms": pack_ms, "checksum_ms": checksum_ms,
                      "transfer_ms": total_ms - pack_ms - checksum_ms, "buckets": len(self.posts)}
        if copy_ms:  # the engine's own time per bucket (copy-out and checksum), where it reports it
            out.phases["engine_copy_ms"] = copy_ms
        return out

    def abandon(self) -> None:
        """Send nothing more, and return only when no post still reads a buffer the caller reuses."""
        self.failed.set()
        for post in self.posts:
            post.cancel()
        futures_wait(self.posts)


class VLLMBucketEmitter:
    """Trainer side of a bucketed transfer into a titan_lora vLLM engine; its buffers (packing and lent)
    are of `transport`."""

    def __init__(self, client: JsonClient, bucket_mb: int, transport: TransportChoice = TransportChoice()) -> None:
        self.client = client
        self.bucket_bytes = bucket_mb * 2**20
        self.transport = transport
        self._buffers: list[BucketBuffer] = []
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="titan-bucket")
        self._sent_layouts: set[str] = set()
        self._plan_key: tuple = ()
        self._plan_of: tuple[Mapping[str, torch.Tensor], BucketBuffer | None, bool] | None = None
        self._plan: list[_PlannedBucket] = []
        # One transfer at a time: two would pack into the same two buffers (a replica's revival can start
        # a base send while a fan-out call is still running on this emitter).
        self._sending = threading.Lock()

    def _info(self) -> dict:
        return self.client.post(protocol.path(protocol.INFO))

    def engine_limits(self) -> EngineLimits:
        """Rank, slots, target modules and expert LoRA of the engine as it was started."""
        info = self._info()
        targets = info["target_modules"]
        return EngineLimits(info["max_lora_rank"], info["max_loras"], None if targets is None else frozenset(targets),
                            info.get("expert_lora"))

    def engine_incarnation(self) -> str:
        """The engine's id, suffixed while it holds no base from us."""
        return protocol.incarnation_of(self._info())

    def check_live(self, timeout_s: float) -> None:
        """Raise EngineHung unless the engine's core and workers answer a no-op within `timeout_s`."""
        self.client.check_live(timeout_s)

    def interrupt(self, reason: str) -> None:
        """End the requests in flight now (the engine was found wedged): each raises EngineHung."""
        self.client.interrupt(reason)

    def lend_buffer(self, numel: int, dtype: torch.dtype, device: torch.device,
                    ) -> tuple[torch.Tensor, BucketBuffer | None]:
        """A tensor in memory the engine reaches (shared memory, CUDA IPC, tcp): written there, the adapter
        is posted in place."""
        return lend_buffer(numel, dtype, device, self.transport)

    def _buffers_fit(self, need: int, device: torch.device) -> bool:
        return bool(self._buffers) and self._buffers[0].size >= need and self._buffers[0].device == device

    def _ensure_buffers(self, need: int, device: torch.device) -> None:
        """Two packing buffers of at least `need` bytes on `device`; no post may be reading the old ones."""
        if self._buffers_fit(need, device):
            return
        for buf in self._buffers:
            buf.close()
        try:
            self._buffers = make_buffers(2, max(need, self.bucket_bytes), device, self.transport)
        except OSError as err:  # an TransferError reaches every rank; an OSError would only stop rank 0
            self._buffers = []
            raise TransferError(str(err)) from err

    def _plan_for(self, tensors: Mapping[str, torch.Tensor], shared: BucketBuffer | None,
                  whole: bool = False) -> list[_PlannedBucket]:
        """Buckets for `tensors`, reused while names, shapes, dtypes and storage stay the same (the
        gatherer hands out the same views every sync); a run that lies in `shared` goes from there.
        The same read-only mapping again (`AdapterSource` gives one per run) is recognised without
        a look at its 448 tensors; any other mapping is keyed by every tensor."""
        held = self._plan_of
        if held is not None and held[0] is tensors and held[1] is shared and held[2] == whole:
            return self._plan
        key = (id(shared), whole, *((name, t.data_ptr(), t.shape, t.dtype) for name, t in tensors.items()))
        # Held, so no other mapping can take its id; a plain dict may change in place, so it is not kept.
        self._plan_of = (tensors, shared, whole) if isinstance(tensors, types.MappingProxyType) else None
        if key != self._plan_key:
            self._plan = []
            for entries in self._bucket_entries(tensors, shared if whole else None):
                run = one_run(entries, tensors)
                offset = None if run is None or shared is None else offset_in(shared, run)
                home = None if offset is None else (shared, offset)
                self._plan.append(
                    _PlannedBucket(entries, run, layout_id(entries), bucket_size(entries), home))
            self._plan_key = key
        return self._plan

    def _bucket_entries(self, tensors: Mapping[str, torch.Tensor], shared: BucketBuffer | None) -> list[list]:
        """The tensors' buckets: one when they all lie back to back in `shared` (several adapters gathered
        together: no copy, the gather's own checksum of those bytes serves and one engine round trip, however
        many MiB: docs/benchmarks.md row 22), else `bucket_mb` each."""
        if shared is not None:
            (whole,) = plan_buckets(tensors, sys.maxsize)
            run = one_run(whole, tensors)
            if run is not None and offset_in(shared, run) is not None:
                return [whole]
        return plan_buckets(tensors, self.bucket_bytes)

    def _transfer(self, kind: str, fill: Callable[[_Transfer], T]) -> tuple[T, _Streamed]:
        """Run `fill` to post a transfer's buckets, then collect the acks; on any failure, abandon it. A
        transfer waits for the one running on this emitter to end."""
        with self._sending:
            transfer = _Transfer(self, kind)
            try:
                filled = fill(transfer)
                return filled, transfer.finish()
            except BaseException:
                transfer.abandon()
                raise

    def _post_planned(
        self, transfer: _Transfer, tensors: Mapping[str, torch.Tensor], shared: BucketBuffer | None,
        commit: dict | None, shared_checksum: tuple[int, int, str] | None = None, whole: bool = False,
    ) -> None:
        """Post `tensors` in planned buckets; `commit` rides on the last one. `shared_checksum`: (offset,
        size, checksum) of bytes in `shared` already checksummed; a bucket of exactly them reuses it."""
        buckets = self._plan_for(tensors, shared, whole)
        to_pack = [b for b in buckets if b.home is None]
        if to_pack:
            self._ensure_buffers(max(b.size for b in to_pack), next(iter(tensors.values())).device)
        inline = len(buckets) == 1
        for k, bucket in enumerate(buckets):
            last = commit if k == len(buckets) - 1 else None
            if bucket.home is not None:  # already in shared memory (the gatherer's output): no copy
                known = shared_checksum[2] if shared_checksum and shared_checksum[:2] == (
                    bucket.home[1], bucket.size) else None
                transfer.post(bucket.entries, *bucket.home, layout=bucket.layout, commit=last, inline=inline,
                              checksum=known)
                continue
            slot = transfer.take_slot()
            t0 = time.perf_counter()  # the copy alone: waiting for the slot is the engine's time
            pack(self._buffers[slot].tensor, bucket.entries, tensors, bucket.run)
            transfer.pack_s += time.perf_counter() - t0
            transfer.post(bucket.entries, self._buffers[slot], 0, layout=bucket.layout, slot=slot,
                          commit=last, inline=inline)

    def _post_streamed(
        self, transfer: _Transfer, items: Iterable[tuple[str, torch.Tensor]]
    ) -> tuple[int, int]:
        """Pack each tensor into the current bucket as it arrives (holding none of them afterwards), post
        each bucket once full; returns the tensors and bytes sent."""
        entries: list[Entry] = []
        slot, count, nbytes = 0, 0, 0
        for name, t in items:
            size = t.numel() * t.element_size()
            used = next_offset(entries[-1]) if entries else 0
            if entries and used + size > self.bucket_bytes:
                transfer.post(entries, self._buffers[slot], 0, slot=slot)
                entries, used = [], 0
            if not entries:
                if not self._buffers_fit(size, t.device):  # larger than a bucket, or another device
                    transfer.drain()
                    self._ensure_buffers(size, t.device)
                slot = transfer.take_slot()
            entries.append(entry_for(name, t, used))
            t0 = time.perf_counter()  # the copy alone: posts (their checksum) and slot waits are apart
            pack_one(self._buffers[slot].tensor, entries[-1], t)
            transfer.pack_s += time.perf_counter() - t0
            count, nbytes = count + 1, nbytes + size
            del t  # the loop variable would keep this tensor alive while the next one is gathered
        if entries:
            transfer.post(entries, self._buffers[slot], 0, slot=slot)
        return count, nbytes

    def _post_bucket(self, transfer: _Transfer, bucket: _Posted, commit: dict | None) -> dict:
        """Send one bucket and check the engine's checksum of what it copied out (post thread)."""
        if transfer.failed.is_set():
            raise TransferError(f"transfer {transfer.id} abandoned: an earlier bucket failed")
        try:
            ack = self._send_bucket(transfer, bucket, commit)
            if ack.get("checksum") != bucket.checksum:
                raise TransferError(
                    f"checksum mismatch in bucket {bucket.index} of the {transfer.kind} transfer "
                    f"{transfer.id}: sent {bucket.checksum}, the engine copied out {ack.get('checksum')} "
                    "(None: the engine does not checksum; run the same titan_lora on both sides)")
            return ack
        except BaseException:
            transfer.failed.set()
            raise

    def _send_bucket(self, transfer: _Transfer, bucket: _Posted, commit: dict | None) -> dict:
        """One /titan/bucket request; the header goes only the first time the engine sees its layout."""
        body = {"transfer_id": transfer.id, "kind": transfer.kind, "layout": bucket.layout,
                "segment": bucket.buf.describe(bucket.offset), "checksum": bucket.checksum}
        if commit is not None:
            body["commit"] = commit
        if bucket.layout not in self._sent_layouts:
            body["header"] = [e.to_json() for e in bucket.entries]
        try:
            ack = self.client.post(protocol.path(protocol.BUCKET), body)
        except LayoutUnknownToEngine:  # the engine restarted and forgot it
            ack = self.client.post(protocol.path(protocol.BUCKET), {**body, "header": [e.to_json() for e in bucket.entries]})
        self._sent_layouts.add(bucket.layout)
        return ack

    @staticmethod
    def _check(what: str, want_tensors: int, want_bytes: int, streamed: _Streamed) -> None:
        if (streamed.tensors, streamed.bytes) != (want_tensors, want_bytes):
            raise TransferError(
                f"the engine acknowledged {streamed.tensors} tensors / {streamed.bytes} bytes of the {what}, "
                f"but {want_tensors} / {want_bytes} were sent"
            )

    def send_base(self, tensors: BaseTensors, version: int, complete_from_disk: bool = False) -> Ack:
        """Stream the full base weights (packed as they arrive), then have the engine load them."""
        (count, nbytes), streamed = self._transfer(
            "base", lambda tr: self._post_streamed(tr, base_items(tensors)))
        self._check("base weights", count, nbytes, streamed)
        t0 = time.perf_counter()
        commit = {"transfer_id": streamed.transfer_id, "version": version}
        if complete_from_disk:
            commit["complete_from_disk"] = True
        ack = self.client.post(protocol.path(protocol.BASE), commit)
        phases = {**streamed.phases, "apply_ms": (time.perf_counter() - t0) * 1e3}
        return Ack(ack["version"], ack["tensors"], ack["bytes"], phases)

    def send_base_part(self, tensors: BaseTensors, version: int) -> Ack:
        """Stream only `tensors`; the engine reads the rest from its own checkpoint and loads the whole base."""
        return self.send_base(tensors, version, complete_from_disk=True)

    def base_digests(self) -> dict[str, Any]:
        """The engine's record of the base it loaded (dtype, digest per HF name)."""
        return self.client.post(protocol.path(protocol.BASE_DIGESTS))

    def adopt_base(self, version: int) -> None:
        """Have the engine record the base it loaded itself as ours."""
        self.client.post(protocol.path(protocol.BASE_VERIFIED), {"version": version})

    def remember_base_digests(self, ours: dict[str, Any], version: int) -> None:
        """Nothing to keep: this engine's revival goes through the syncer, which holds the digests."""

    def _stream_payload(self, payload: AdapterPayload, commit: dict, whole: bool = False
                        ) -> tuple[dict, dict[str, float]]:
        """Stream `payload`'s tensors, `commit` riding on the last bucket; the commit's ack and the phases.
        `whole`: in one bucket where they lie in the lent buffer (`_bucket_entries`)."""
        _, streamed = self._transfer("adapter", lambda tr: self._post_planned(
            tr, payload.tensors, payload.home, commit, payload.home_checksum, whole))
        self._check(f"adapter {payload.name}", payload.num_tensors, payload.nbytes, streamed)
        ack = streamed.commit
        if ack is None:
            raise TransferError(f"the engine did not acknowledge the commit of adapter {payload.name}")
        apply_ms = float(ack["apply_ms"])  # the engine's own time: the commit shares the last round trip
        transfer_ms = streamed.phases["transfer_ms"] - apply_ms
        return ack, {**streamed.phases, "transfer_ms": transfer_ms, "apply_ms": apply_ms}

    def send_adapter(self, payload: AdapterPayload) -> Ack:
        """Stream the adapter; the last bucket asks the engine to register it under `payload.name`."""
        commit = {"name": payload.name, "version": payload.version, "peft_config": dict(payload.peft_config)}
        ack, phases = self._stream_payload(payload, commit)
        # An engine that names its incarnation in the ack spares the syncer a round trip before each sync.
        incarnation = protocol.incarnation_of(ack) if "incarnation" in ack else None
        return Ack(ack["version"], ack["tensors"], ack["bytes"], phases, incarnation)

    def send_adapters(self, adapters: AdapterSet) -> list[Ack]:
        """Stream every part in one transfer (one bucket from the lent buffer the gather wrote them into, else
        planned over all of them); the last bucket's commit registers each under its own name. The phases go
        with the first ack."""
        commit = {"adapters": [{"name": p.name, "version": p.version, "peft_config": dict(p.peft_config)}
                               for p in adapters.parts]}
        ack, phases = self._stream_payload(adapters.together, commit, whole=True)
        parts = ack.get("adapters")
        if not isinstance(parts, list) or len(parts) != len(adapters.parts):
            raise TransferError(f"the engine acknowledged {len(parts or [])} of the {len(adapters.parts)} adapters "
                                "committed together: run the same titan_lora on both sides")
        incarnation = protocol.incarnation_of(ack) if "incarnation" in ack else None
        return [Ack(part["version"], part["tensors"], part["bytes"], phases if k == 0 else {}, incarnation)
                for k, part in enumerate(parts)]

    def retire_adapter(self, name: str, timeout_s: float) -> bool:
        """Ask the engine to unload `name` once its requests drained; False if it did not in time."""
        reply = self.client.post(protocol.path(protocol.UNLOAD), {"name": name, "timeout_s": timeout_s},
                                 timeout_s=timeout_s + protocol.HTTP_MARGIN_S)
        return bool(reply["unloaded"])

    def close(self) -> None:
        """Free the bucket buffers (after the engine released its mappings of them, if it is to stop)."""
        self._pool.shutdown(wait=True)
        cuda = any(buf.device.type == "cuda" for buf in self._buffers)
        for buf in self._buffers:
            buf.close()
        self._buffers = []
        if cuda:  # shared blocks the engine no longer maps, and their ref-counter files, are freed now
            torch.cuda.ipc_collect()


def build_vllm_emitter(ws: WeightSync, engine: Engine, endpoint: Endpoint) -> VLLMBucketEmitter:
    """The bucket emitter to titan_lora's engine (vLLM or the receiver) at `endpoint`, over its transport."""
    log_route(endpoint.url, f"in buckets over {bucket_route(endpoint.transport)}")
    return VLLMBucketEmitter(JsonClient(endpoint.url, endpoint.api_key, ws.timeout_s), ws.bucket_mb,
                             endpoint.transport)


RECEIVER_SLOTS = 8
"""The receiver's adapter slots unless a job needs more (it holds only bytes: slots cost nothing)."""


def receiver_launch(req: LaunchRequest) -> LaunchPlan:
    """The receiver: vLLM's transfer protocol and copy-out with no inference, on the trainer's device, with a
    slot for every live version of every adapter."""
    return receiver_plan(req.device, max(req.adapter_slots, RECEIVER_SLOTS))


def receiver_plan(device: torch.device, max_loras: int = RECEIVER_SLOTS) -> LaunchPlan:
    """The receiver's process on `device` with `max_loras` adapter slots."""
    cuda = ["--device", str(device)] if device.type == "cuda" else []
    return LaunchPlan("titan_lora.engines.receiver", [*cuda, "--max-loras", str(max_loras)])


RECEIVER = EngineKind("receiver", build_vllm_emitter, None, receiver_launch, shm_buckets=True)
