"""The vLLM bucket emitter: adapter (and base) tensors in double-buffered buckets, acked per bucket.

Bucket k is packed into buffer k % 2 while bucket k-1 is being copied out by the engine; a buffer is
packed again only after the engine acknowledged that it copied the bucket it held (the overwrite
race of verl #5934 cannot happen). The engine side is `titan_lora.engines.vllm_ext`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from titan_lora.config import WeightSync
from titan_lora.emitters.base import AdapterPayload, Ack, EmitterError, EngineLimits, register_emitter
from titan_lora.emitters.buckets import bucket_size, layout_id, pack, plan_buckets
from titan_lora.emitters.transport import BucketBuffer, make_buffers
from titan_lora.engines.http import JsonClient, LayoutUnknownToEngine


class VLLMBucketEmitter:
    """Trainer side of a bucketed transfer into a titan_lora vLLM engine."""

    def __init__(self, client: JsonClient, bucket_mb: int) -> None:
        self.client = client
        self.bucket_bytes = bucket_mb * 2**20
        self._buffers: list[BucketBuffer] = []
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="titan-bucket")
        self._sent_layouts: set[str] = set()

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
        self._buffers = make_buffers(2, max(need, self.bucket_bytes), device)

    def _stream(self, tensors: Mapping[str, torch.Tensor]) -> tuple[str, dict[str, float], int, int]:
        """Send every tensor in buckets; returns (transfer id, phase times, tensors acked, bytes acked)."""
        transfer_id = uuid.uuid4().hex
        buckets = plan_buckets(tensors, self.bucket_bytes)
        device = next(iter(tensors.values())).device
        self._ensure_buffers(max(bucket_size(b) for b in buckets), device)
        in_flight: list[Future | None] = [None, None]
        pack_s, started = 0.0, time.perf_counter()
        acked_tensors = acked_bytes = 0
        for k, entries in enumerate(buckets):
            slot = k % 2
            if in_flight[slot] is not None:  # the engine must have copied this buffer out
                ack = in_flight[slot].result()
                acked_tensors, acked_bytes = acked_tensors + ack["tensors"], acked_bytes + ack["bytes"]
            t0 = time.perf_counter()
            buf = self._buffers[slot]
            pack(buf.tensor, entries, tensors)
            buf.synchronize()
            pack_s += time.perf_counter() - t0
            in_flight[slot] = self._pool.submit(self._post_bucket, transfer_id, buf, entries)
        for fut in in_flight:
            if fut is not None:
                ack = fut.result()
                acked_tensors, acked_bytes = acked_tensors + ack["tensors"], acked_bytes + ack["bytes"]
        total_s = time.perf_counter() - started
        phases = {"pack_ms": pack_s * 1e3, "transfer_ms": (total_s - pack_s) * 1e3, "buckets": len(buckets)}
        return transfer_id, phases, acked_tensors, acked_bytes

    def _post_bucket(self, transfer_id: str, buf: BucketBuffer, entries: list) -> dict:
        """Send one bucket; its header goes only the first time the engine sees its layout."""
        layout = layout_id(entries)
        body = {"transfer_id": transfer_id, "segment": buf.describe(), "layout": layout}
        if layout not in self._sent_layouts:
            body["header"] = [e.to_json() for e in entries]
        try:
            ack = self.client.post("/titan/bucket", body)
        except LayoutUnknownToEngine:  # the engine restarted and forgot it
            ack = self.client.post("/titan/bucket", {**body, "header": [e.to_json() for e in entries]})
        self._sent_layouts.add(layout)
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
        transfer_id, phases, n, nbytes = self._stream(tensors)
        self._check("base weights", tensors, n, nbytes)
        t0 = time.perf_counter()
        ack = self.client.post("/titan/base", {"transfer_id": transfer_id, "version": version})
        phases["apply_ms"] = (time.perf_counter() - t0) * 1e3
        return Ack(ack["version"], ack["tensors"], ack["bytes"], phases)

    def send_adapter(self, payload: AdapterPayload) -> Ack:
        """Stream the adapter, then have the engine register it under `payload.name`."""
        transfer_id, phases, n, nbytes = self._stream(payload.tensors)
        self._check(f"adapter {payload.name}", payload.tensors, n, nbytes)
        t0 = time.perf_counter()
        ack = self.client.post("/titan/adapter", {
            "transfer_id": transfer_id, "name": payload.name, "version": payload.version,
            "peft_config": dict(payload.peft_config),
        })
        phases["apply_ms"] = (time.perf_counter() - t0) * 1e3
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
