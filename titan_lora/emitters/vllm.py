"""The vLLM bucket emitter: adapter (and base) tensors in double-buffered buckets, acked per bucket.

Bucket k is packed into buffer k % 2 while bucket k-1 is being copied out by the engine; a buffer is
packed again only after the engine acknowledged that it copied the bucket it held (the overwrite
race of verl #5934 cannot happen). A bucket whose tensors already lie in a shared buffer (the
gatherer writes the adapter into one, from `transport.shared_tensor`) goes as it is, with no packing
copy: that buffer is written again only by the next gather, after this transfer is acknowledged.
The adapter's commit rides on its last bucket. The engine side is `titan_lora.engines.vllm_ext`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait

import torch

from titan_lora.config import WeightSync
from titan_lora.emitters.base import AdapterPayload, Ack, EmitterError, EngineLimits, register_emitter
from titan_lora.emitters.buckets import Entry, bucket_size, layout_id, one_run, pack, plan_buckets
from titan_lora.emitters.transport import BucketBuffer, home_of, make_buffers
from titan_lora.engines.http import JsonClient, LayoutUnknownToEngine


@dataclasses.dataclass(frozen=True)
class _PlannedBucket:
    entries: list[Entry]
    run: torch.Tensor | None  # the bucket's bytes as one view of the source, when they are contiguous
    layout: str
    size: int
    home: tuple[BucketBuffer, int] | None  # (shared buffer, offset) when the run already lies in one


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


class VLLMBucketEmitter:
    """Trainer side of a bucketed transfer into a titan_lora vLLM engine."""

    def __init__(self, client: JsonClient, bucket_mb: int) -> None:
        self.client = client
        self.bucket_bytes = bucket_mb * 2**20
        self._buffers: list[BucketBuffer] = []
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="titan-bucket")
        self._sent_layouts: set[str] = set()
        self._plan_key: tuple = ()
        self._plan: list[_PlannedBucket] = []

    def _info(self) -> dict:
        return self.client.post("/titan/info")

    def engine_limits(self) -> EngineLimits:
        """Rank, slots and target modules the engine was started with."""
        info = self._info()
        targets = info["target_modules"]
        return EngineLimits(info["max_lora_rank"], info["max_loras"], None if targets is None else frozenset(targets))

    def engine_incarnation(self) -> str:
        """The engine's id, suffixed while it holds no base from us."""
        info = self._info()
        return info["incarnation"] + ("" if info["base_version"] is not None else ":no-base")

    def _ensure_buffers(self, need: int, device: torch.device) -> None:
        if self._buffers and self._buffers[0].size >= need and self._buffers[0].device == device:
            return
        for buf in self._buffers:
            buf.close()
        try:
            self._buffers = make_buffers(2, max(need, self.bucket_bytes), device)
        except OSError as err:  # an EmitterError reaches every rank; an OSError would only stop rank 0
            self._buffers = []
            raise EmitterError(str(err)) from err

    def _plan_for(self, tensors: Mapping[str, torch.Tensor]) -> list[_PlannedBucket]:
        """Buckets for `tensors`, reused while names, shapes, dtypes and storage stay the same (the
        gatherer hands out the same views every sync)."""
        key = tuple((name, t.data_ptr(), t.shape, t.dtype) for name, t in tensors.items())
        if key != self._plan_key:
            self._plan = []
            for entries in plan_buckets(tensors, self.bucket_bytes):
                run = one_run(entries, tensors)
                home = None if run is None else home_of(run)
                self._plan.append(
                    _PlannedBucket(entries, run, layout_id(entries), bucket_size(entries), home))
            self._plan_key = key
        return self._plan

    def _stream(
        self, tensors: Mapping[str, torch.Tensor], kind: str, commit: dict | None = None
    ) -> _Streamed:
        """Send every tensor in buckets (`kind`: "adapter" or "base"); `commit` rides on the last one."""
        transfer_id = uuid.uuid4().hex
        buckets = self._plan_for(tensors)
        to_pack = [b for b in buckets if b.home is None]
        if to_pack:
            self._ensure_buffers(max(b.size for b in to_pack), next(iter(tensors.values())).device)
        posts: list[Future] = []
        last_post: list[Future | None] = [None, None]  # per packing buffer
        failed = threading.Event()  # set by a failed post: later ones (and the commit) are not sent
        out = _Streamed(transfer_id)
        pack_s, started, packed = 0.0, time.perf_counter(), 0
        try:
            for k, bucket in enumerate(buckets):
                t0 = time.perf_counter()
                if bucket.home is not None:  # already in shared memory (the gatherer's output): no copy
                    buf, offset = bucket.home
                else:
                    slot, packed = packed % 2, packed + 1
                    if last_post[slot] is not None:
                        last_post[slot].result()  # the engine must have copied this buffer out
                    buf, offset = self._buffers[slot], 0
                    pack(buf.tensor, bucket.entries, tensors, bucket.run)
                buf.synchronize()
                pack_s += time.perf_counter() - t0
                last = commit if k == len(buckets) - 1 else None
                posts.append(self._pool.submit(self._post_bucket, transfer_id, kind, buf, offset, bucket, last,
                                               failed))
                if bucket.home is None:
                    last_post[slot] = posts[-1]
            for post in posts:  # in order: the last one carries the commit
                out.add(post.result())
        except BaseException:
            failed.set()
            for post in posts:
                post.cancel()
            futures_wait(posts)  # no post may still read a buffer the caller reuses
            raise
        total_s = time.perf_counter() - started
        out.phases = {"pack_ms": pack_s * 1e3, "transfer_ms": (total_s - pack_s) * 1e3,
                      "buckets": len(buckets)}
        return out

    def _post_bucket(
        self, transfer_id: str, kind: str, buf: BucketBuffer, offset: int, bucket: _PlannedBucket,
        commit: dict | None, failed: threading.Event,
    ) -> dict:
        """Send one bucket; its header goes only the first time the engine sees its layout."""
        if failed.is_set():
            raise EmitterError(f"transfer {transfer_id} abandoned: an earlier bucket failed")
        try:
            return self._send_bucket(transfer_id, kind, buf, offset, bucket, commit)
        except BaseException:
            failed.set()
            raise

    def _send_bucket(
        self, transfer_id: str, kind: str, buf: BucketBuffer, offset: int, bucket: _PlannedBucket,
        commit: dict | None,
    ) -> dict:
        body = {"transfer_id": transfer_id, "kind": kind, "segment": buf.describe(offset),
                "layout": bucket.layout}
        if commit is not None:
            body["commit"] = commit
        if bucket.layout not in self._sent_layouts:
            body["header"] = [e.to_json() for e in bucket.entries]
        try:
            ack = self.client.post("/titan/bucket", body)
        except LayoutUnknownToEngine:  # the engine restarted and forgot it
            ack = self.client.post("/titan/bucket", {**body, "header": [e.to_json() for e in bucket.entries]})
        self._sent_layouts.add(bucket.layout)
        return ack

    def _check(self, what: str, sent: Mapping[str, torch.Tensor], tensors: int, nbytes: int) -> None:
        want_bytes = sum(t.numel() * t.element_size() for t in sent.values())
        if tensors != len(sent) or nbytes != want_bytes:
            raise EmitterError(
                f"the engine acknowledged {tensors} tensors / {nbytes} bytes of the {what}, "
                f"but {len(sent)} / {want_bytes} were sent"
            )

    def send_base(self, tensors: Mapping[str, torch.Tensor], version: int) -> Ack:
        """Stream the full base weights, then have the engine load them."""
        streamed = self._stream(tensors, "base")
        self._check("base weights", tensors, streamed.tensors, streamed.bytes)
        t0 = time.perf_counter()
        ack = self.client.post("/titan/base", {"transfer_id": streamed.transfer_id, "version": version})
        phases = {**streamed.phases, "apply_ms": (time.perf_counter() - t0) * 1e3}
        return Ack(ack["version"], ack["tensors"], ack["bytes"], phases)

    def send_adapter(self, payload: AdapterPayload) -> Ack:
        """Stream the adapter; the last bucket asks the engine to register it under `payload.name`."""
        commit = {"name": payload.name, "version": payload.version, "peft_config": dict(payload.peft_config)}
        streamed = self._stream(payload.tensors, "adapter", commit)
        self._check(f"adapter {payload.name}", payload.tensors, streamed.tensors, streamed.bytes)
        ack = streamed.commit
        if ack is None:
            raise EmitterError(f"the engine did not acknowledge the commit of adapter {payload.name}")
        apply_ms = float(ack["apply_ms"])  # the engine's own time: the commit shares the last round trip
        transfer_ms = streamed.phases["transfer_ms"] - apply_ms
        phases = {**streamed.phases, "transfer_ms": transfer_ms, "apply_ms": apply_ms}
        return Ack(ack["version"], ack["tensors"], ack["bytes"], phases)

    def retire_adapter(self, name: str, timeout_s: float) -> bool:
        """Ask the engine to unload `name` once its requests drained; False if it did not in time."""
        reply = self.client.post("/titan/unload", {"name": name, "timeout_s": timeout_s}, timeout_s=timeout_s + 10)
        return bool(reply["unloaded"])

    def close(self) -> None:
        """Free the bucket buffers."""
        self._pool.shutdown(wait=True)
        for buf in self._buffers:
            buf.close()
        self._buffers = []


@register_emitter("vllm")
def build_vllm_emitter(cfg: WeightSync) -> VLLMBucketEmitter:
    """The vLLM bucket emitter for `[weight_sync]`."""
    if not cfg.engine_url:
        raise ValueError("[weight_sync] engine_url is empty: leave it empty in the TOML to have titan_lora start an engine")
    return VLLMBucketEmitter(JsonClient(cfg.engine_url, cfg.api_key, cfg.timeout_s), cfg.bucket_mb)
