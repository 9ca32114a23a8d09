"""The SGLang emitter: base by `/update_weights_from_tensor`, adapters by `/load_lora_adapter_from_tensors`.

Payloads use SGLang's `flattened_bucket` load format: one flat uint8 tensor plus per-tensor metadata
(name, shape, dtype, byte range), pickled once per engine TP rank and base64-encoded into the JSON.
How the flat tensor is pickled depends on where it lives:
- CPU (remote engine): plain pickle, which embeds the bytes. torch's ForkingPickler would instead
  move a CPU tensor into shared memory and pickle a file-descriptor handle that only a process on
  the same host (while this one lives) can open.
- CUDA (colocated engine): ForkingPickler, i.e. a CUDA IPC handle. The GPU is named by UUID, as
  SGLang's patched receiver expects, so differing CUDA_VISIBLE_DEVICES do not matter. Every bucket
  is fresh memory that is never reused, so the engine cannot read a buffer we overwrite.

Engine incarnation: SGLang 0.5.23 reports no restart id, but `/model_info` reports the served
`weight_version`, which our base update sets to a token of ours and a restart resets to the
server's launch value. A changed version therefore means "send the base again".
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import io
import logging
import pickle
import sys
import time
import types
import uuid
from collections.abc import Iterator, Mapping, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any

import torch
import torch.multiprocessing  # registers torch's reducers on ForkingPickler
from torch.multiprocessing import reductions

from titan_lora.clients.base import AdapterPayload, BaseTensors, Endpoint, base_items, log_route
from titan_lora.clients.kinds import EngineKind
from titan_lora.clients.sglang_api import (
    LoadLoRAAdapterFromTensorsReqInput,
    ServerInfo,
    SGLangClient,
    SGLangTimeout,
    UpdateWeightsFromTensorReqInput,
)
from titan_lora.clients.sglang_checks import (
    adapter_modules,
    check_adapter,
    check_fused_targets,
    check_server,
    engine_sees_gpu,
    sglang_adapter_config,
)
from titan_lora.clients.sglang_rollout import sglang_rollouts
from titan_lora.transfer.buckets import Entry, bucket_size, pack, plan_buckets, stream_buckets
from titan_lora.transfer.errors import EngineWeightsLost, TransferError
from titan_lora.transfer.protocol import Ack, EngineLimits
from titan_lora.transfer.transport import plain_buffer

if TYPE_CHECKING:
    from titan_lora.config import Engine, WeightSync

logger = logging.getLogger(__name__)

FLATTENED_BUCKET = "flattened_bucket"
_CUDA_DEVICE_ARG = 6  # index of the device in rebuild_cuda_tensor's args (sglang/srt/utils/patch_torch.py)
_SAMPLE_ROWS = 2  # rows read back per sampled base tensor after an update
_SAMPLES = 8  # base tensors read back after an update


# ---- payload format ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Tensors packed into one flat uint8 tensor, with SGLang's FlattenedTensorMetadata fields."""

    flat: torch.Tensor
    metadata: list[types.SimpleNamespace]

    def payload(self) -> dict[str, Any]:
        """The object SGLang unpickles for `load_format="flattened_bucket"`."""
        # SimpleNamespace is on SGLang's unpickling allow-list and carries the attributes its
        # FlattenedTensorBucket reads; SGLang's own metadata class cannot be pickled without sglang.
        return {"flattened_tensor": self.flat, "metadata": self.metadata}

    def on_cpu(self) -> Bucket:
        """The same bucket with its bytes in host memory (for an engine that cannot open our GPU)."""
        return self if not self.flat.is_cuda else Bucket(self.flat.cpu(), self.metadata)

    def checksums(self) -> dict[str, str]:
        """sha256 per tensor over its bytes, as SGLang checks `expected_checksums`."""
        flat = self.flat.cpu().numpy()
        return {m.name: hashlib.sha256(flat[m.start_idx:m.end_idx]).hexdigest() for m in self.metadata}


def pack_bucket(entries: Sequence[Entry], tensors: Mapping[str, torch.Tensor]) -> Bucket:
    """Pack one planned bucket (`buckets.plan_buckets`) into fresh memory on its first tensor's device."""
    device = tensors[entries[0].name].device
    # Fresh for every bucket, so the engine never reads memory we reuse; zeros, so padding carries no
    # stale process memory to another host.
    flat = torch.zeros(bucket_size(entries), dtype=torch.uint8, device=device)
    pack(flat, entries, tensors)
    metadata = [types.SimpleNamespace(name=e.name, shape=torch.Size(e.shape), dtype=getattr(torch, e.dtype),
                                      start_idx=e.offset, end_idx=e.offset + e.nbytes, numel=e.nbytes)
                for e in entries]
    return Bucket(flat, metadata)


def _reduce_cuda_by_uuid(t: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    rebuild, args = reductions.reduce_tensor(t)
    if rebuild is reductions.rebuild_cuda_tensor:
        uid = str(torch.cuda.get_device_properties(args[_CUDA_DEVICE_ARG]).uuid)
        args = (*args[:_CUDA_DEVICE_ARG], uid, *args[_CUDA_DEVICE_ARG + 1:])
    return rebuild, args


def serialize_for_ranks(obj: Mapping[str, Any], tp_size: int, cuda: bool) -> list[str]:
    """Base64 MultiprocessingSerializer payloads of `obj`, one per engine TP rank."""
    if not cuda:
        buf = io.BytesIO()
        pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        return [base64.b64encode(buf.getvalue()).decode("ascii")] * tp_size
    out = []
    for _ in range(tp_size):  # a separate handle per rank: each rank's open consumes its own refcount
        buf = io.BytesIO()
        pickler = ForkingPickler(buf, pickle.HIGHEST_PROTOCOL)
        pickler.dispatch_table = {**pickler.dispatch_table, torch.Tensor: _reduce_cuda_by_uuid}
        pickler.dump(obj)
        out.append(base64.b64encode(buf.getvalue()).decode("ascii"))
    return out


# ---- the emitter ---------------------------------------------------------------------------------


class SGLangEmitter:
    """Trainer side of weight sync into one SGLang 0.5.23 server; only rank 0 calls it.

    A control request that raises ends an SGLang server, so nothing is sent that SGLang would raise
    on: names and shapes are checked against the served model, checksums locally, targets against
    SGLang's fusing rules, and CUDA IPC handles go only to an engine known to be able to open them.
    """

    def __init__(self, client: SGLangClient, *, keep_versions: int, pause_mode: str = "none",
                 bucket_bytes: int = 32 << 20, verify_checksums: bool = True) -> None:
        self.client = client
        self._keep_versions = keep_versions
        self._pause_mode = pause_mode
        self._bucket_bytes = bucket_bytes
        self._verify = verify_checksums
        self._token = uuid.uuid4().hex[:12]  # marks the weight versions that this emitter installed
        self._installed: str | None = None  # weight_version of our last base: the incarnation we fed
        self._info: ServerInfo | None = None
        self._limits: EngineLimits | None = None
        self._colocated: dict[int, bool] = {}  # our GPU index -> can the engine open its IPC handles
        self._served_shapes: dict[str, tuple[int, ...] | None] = {}  # base name -> served trailing dims
        self._kv_released = False

    def _refresh(self) -> EngineLimits:
        self._info = self.client.server_info()
        self._limits = check_server(self._info, self.client.url, self._keep_versions)
        return self._limits

    lend_buffer = staticmethod(plain_buffer)  # buckets are packed per TP rank: the gather needs no shared memory

    def engine_limits(self) -> EngineLimits:
        """The server's LoRA limits; raises, naming the flag, if it cannot serve our retention window."""
        return self._refresh()

    def engine_incarnation(self) -> str:
        """The served weight_version: ours after send_base, the launch value after a restart."""
        return self.client.weight_version()

    def _wire(self, bucket: Bucket) -> list[str]:
        """The bucket's payloads: CUDA IPC handles only for an engine that can open them, else bytes."""
        assert self._info is not None
        if bucket.flat.is_cuda:
            index = bucket.flat.device.index or 0
            if index not in self._colocated:  # probed once per GPU
                host, port = self.client.host_port
                self._colocated[index] = engine_sees_gpu(host, port, self._info, index)
                logger.info("SGLang at %s %s GPU %d: payloads go as %s", self.client.url,
                            "sees" if self._colocated[index] else "cannot open handles of", index,
                            "CUDA IPC handles" if self._colocated[index] else "bytes")
            if not self._colocated[index]:
                bucket = bucket.on_cpu()
        return serialize_for_ranks(bucket.payload(), self._info.tp_size, bucket.flat.is_cuda)

    @contextlib.contextmanager
    def _paused(self) -> Iterator[None]:
        if self._pause_mode == "none":
            yield
            return
        self.client.pause_generation(self._pause_mode)  # type: ignore[arg-type]
        try:
            yield
        finally:
            self.client.continue_generation()

    def send_base(self, tensors: BaseTensors, version: int) -> Ack:
        """Install the full base (HF names), bucket by bucket in one weight-update session, packing each
        bucket as its tensors arrive; then read a sample back by name."""
        t0 = time.perf_counter()
        self._refresh()
        assert self._info is not None
        token = f"titan-lora-{self._token}-base-v{version}"
        # in_place keeps running requests and their KV, so the flush waits until they finish.
        in_place = self._pause_mode == "in_place"
        with self._paused():
            self._begin_session()
            try:
                count, nbytes, sample = self._stream_base(tensors, version, token, in_place)
            finally:
                end = self.client.end_weight_update()
            if not end.success:
                raise TransferError(f"SGLang could not close the weight update of version {version}: "
                                   f"{end.message}")
        if not count:  # the session closed having changed nothing
            raise TransferError(f"send_base of version {version} got no tensors")
        if in_place and not self.client.flush_cache(wait_idle_s=self.client.timeout_s):
            logger.warning("SGLang kept its prefix cache after the base update (requests never drained); "
                           "cached prefixes computed with the old base may be reused")
        served = self.client.weight_version()
        if served != token:
            raise TransferError(f"SGLang acknowledged base version {version} but serves weight_version "
                               f"{served!r}, not {token!r}: the update did not take effect")
        self._read_back(sample, version)  # the flip alone proves nothing: a loader skips what it misses
        self._installed = token
        return Ack(version, count, nbytes, {"base_ms": (time.perf_counter() - t0) * 1e3})

    def _stream_base(self, tensors: BaseTensors, version: int, token: str,
                     in_place: bool) -> tuple[int, int, dict[str, torch.Tensor]]:
        """Send the base bucket by bucket, each packed once its tensors arrived and checked against the
        served model; (tensors, bytes, a sample of leading rows to read back) sent."""
        count, nbytes, sample = 0, 0, {}
        for i, (entries, group, last) in enumerate(stream_buckets(base_items(tensors), self._bucket_bytes)):
            self._check_base_names(entries)
            bucket = pack_bucket(entries, group)
            req = UpdateWeightsFromTensorReqInput(
                self._wire(bucket), load_format=FLATTENED_BUCKET, flush_cache=last and not in_place,
                weight_version=token if last else None)  # the version flips only when complete
            res = self.client.update_weights_from_tensor(req)
            if not res.success:
                raise TransferError(f"SGLang refused base bucket {i + 1} of version {version}: {res.message}")
            count, nbytes = count + len(entries), nbytes + sum(e.nbytes for e in entries)
            if len(sample) < _SAMPLES:
                first = group[entries[0].name].detach()
                rows = first[:_SAMPLE_ROWS] if first.dim() else first.reshape(1)
                sample[entries[0].name] = rows.float().cpu().clone()
        return count, nbytes, sample

    def _check_base_names(self, entries: Sequence[Entry]) -> None:
        """Refuse tensors the served model lacks (its loader would skip them silently) or whose trailing
        dims differ (a wrong shape raises inside SGLang and ends the server). One probe per name."""
        for e in entries:
            if e.name not in self._served_shapes:
                rows = self.client.get_weights_by_name(e.name, 1)
                # A 2-D+ parameter answers [[row...]]: its trailing dims; a 1-D one only its first value.
                self._served_shapes[e.name] = None if rows is None else _trailing_dims(rows)
        unknown = [e.name for e in entries if self._served_shapes[e.name] is None]
        if unknown:
            raise TransferError(f"SGLang at {self.client.url} serves no parameter named {unknown[:5]}: its "
                               "loader would skip them silently; export the base in the served model's HF "
                               "names (check the model family's state-dict adapter)")
        wrong = [(e.name, tuple(e.shape), self._served_shapes[e.name]) for e in entries
                 if len(e.shape) > 1 and tuple(e.shape[1:]) != self._served_shapes[e.name]]
        if wrong:
            raise TransferError(f"base tensors whose trailing dims differ from the served model's "
                               f"(name, ours, served): {wrong[:3]}; SGLang would crash on them: check that "
                               "the trainer and the server load the same model")

    def _read_back(self, sample: Mapping[str, torch.Tensor], version: int) -> None:
        """Compare the leading rows of sampled base tensors, as the server now serves them, to ours."""
        for name, ours in sample.items():
            rows = self.client.get_weights_by_name(name, _SAMPLE_ROWS)
            served = None if rows is None else torch.tensor(rows, dtype=torch.float32).reshape(ours.shape)
            # rtol covers a server that stores the weights in bf16
            if served is None or not torch.allclose(served, ours, rtol=1e-2, atol=1e-3):
                raise TransferError(f"SGLang took base version {version} but serves {name} differently from "
                                   "what was sent: the loader skipped or remapped it; check the HF names "
                                   "of the export against the served model")

    def _begin_session(self) -> None:
        res = self.client.begin_weight_update()
        if not res.success and "already open" in res.message:
            # A trainer that died mid-update left its session open: close it and start ours.
            logger.warning("closing a weight-update session left open on %s", self.client.url)
            self.client.end_weight_update()
            res = self.client.begin_weight_update()
        if not res.success:
            raise TransferError(f"SGLang could not open a weight-update session: {res.message}")

    def send_adapter(self, payload: AdapterPayload) -> Ack:
        """Load `payload` under its versioned name; EngineWeightsLost if our base is not served."""
        served = self.engine_incarnation()
        if self._installed is None or served != self._installed:
            raise EngineWeightsLost(f"SGLang at {self.client.url} serves weight_version {served!r}, not the "
                                    f"base this trainer sent ({self._installed!r}): send the base first")
        limits = self._limits or self._refresh()
        config = sglang_adapter_config(payload.peft_config)
        check_adapter(limits, self.client.url, int(config["r"]), adapter_modules(list(payload.tensors)))
        t0 = time.perf_counter()
        [entries] = plan_buckets(payload.tensors, sys.maxsize)  # one bucket: the load is all or nothing
        bucket = pack_bucket(entries, payload.tensors)
        checksums = _verified_checksums(bucket, payload.tensors) if self._verify else None
        t1 = time.perf_counter()
        req = LoadLoRAAdapterFromTensorsReqInput(
            lora_name=payload.name, config_dict=config, serialized_named_tensors=self._wire(bucket),
            load_format=FLATTENED_BUCKET, expected_checksums=checksums)
        t2 = time.perf_counter()
        with self._paused():
            res = self.client.load_lora_adapter_from_tensors(req)
            if not res.success and ("already loaded" in res.message or "incomplete unload" in res.message):
                # "already loaded": a stale copy (an attempt that timed out on our side but finished, or a
                # previous run that reached this step). "incomplete unload": a load that failed on some TP
                # ranks parked the name. This run never published it: unload it and load again.
                logger.warning("SGLang holds %s (%s); unloading it and loading again", payload.name, res.message)
                if self.retire_adapter(payload.name, self.client.timeout_s):
                    res = self.client.load_lora_adapter_from_tensors(req)
        t3 = time.perf_counter()
        if not res.success:
            raise TransferError(f"SGLang refused adapter {payload.name}: {res.message}")
        if payload.name not in (res.loaded_adapters or {}):
            raise TransferError(f"SGLang acknowledged adapter {payload.name} but does not list it as loaded "
                               f"(loaded: {sorted(res.loaded_adapters or {})})")
        phases = {"pack_ms": (t1 - t0) * 1e3, "serialize_ms": (t2 - t1) * 1e3,
                  "transfer_apply_ms": (t3 - t2) * 1e3}
        return Ack(payload.version, payload.num_tensors, payload.nbytes, phases)

    def retire_adapter(self, name: str, timeout_s: float) -> bool:
        """Unload a drained adapter within `timeout_s`; False if it did not finish (slowness never raises)."""
        try:
            res = self.client.unload_lora_adapter(name, timeout_s)
        except SGLangTimeout:
            logger.warning("unloading %s on %s took over %.1fs; the server keeps working on it",
                           name, self.client.url, timeout_s)
            return False
        if res.success or "does not exist" in res.message:  # already gone (e.g. the server restarted)
            return True
        logger.warning("SGLang refused to unload %s: %s", name, res.message)
        return False

    def release_kv_cache(self) -> None:
        """Free the engine's KV cache (never its weights: in adapter mode the base must stay).

        SGLang asserts that it is idle inside the scheduler (a busy server dies) and frees nothing
        without --enable-memory-saver, so this needs the flag and waits, bounded, for the server to drain.
        """
        info = self._info or self.client.server_info()
        if not info.enable_memory_saver:
            raise TransferError(f"SGLang at {self.client.url} was started without --enable-memory-saver, so "
                               "releasing its KV cache would free nothing: restart it with that flag")
        if not self.client.flush_cache(wait_idle_s=self.client.timeout_s):
            raise TransferError(f"SGLang at {self.client.url} still runs requests after {self.client.timeout_s}s;"
                               " releasing memory now would end the server: finish the rollouts first")
        self.client.release_kv_cache()
        self._kv_released = True

    def resume_kv_cache(self) -> None:
        """Re-allocate the KV cache after `release_kv_cache` (SGLang dies resuming what it never released)."""
        if not self._kv_released:
            raise TransferError("resume_kv_cache without release_kv_cache: SGLang would fail on a tag it never "
                               "released and end the server")
        self.client.resume_kv_cache()
        self._kv_released = False

    def check_live(self, timeout_s: float) -> None:
        """Raise EngineHung unless SGLang's scheduler answers `/health_generate` within `timeout_s`."""
        self.client.check_live(timeout_s)

    def interrupt(self, reason: str) -> None:
        """End the requests in flight now (the server was found wedged): each raises EngineHung."""
        self.client.interrupt(reason)

    def close(self) -> None:
        """Nothing to release: the client opens one connection per request."""


def _trailing_dims(rows: list[Any]) -> tuple[int, ...]:
    """The dims after the first of a parameter answered as nested lists ([] for a 1-D one)."""
    dims: list[int] = []
    node = rows[0] if rows else None
    while isinstance(node, list):
        dims.append(len(node))
        node = node[0] if node else None
    return tuple(dims)


def _verified_checksums(bucket: Bucket, tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """The bucket's per-tensor sha256, checked against the source tensors: SGLang raises on a mismatch,
    and a raise ends the server, so a packing fault must stop here."""
    for m in bucket.metadata:  # compared where the tensors live: no host copy, no second hash
        source = tensors[m.name].detach().contiguous().view(-1).view(torch.uint8)
        if not torch.equal(bucket.flat[m.start_idx : m.end_idx], source):
            raise TransferError(f"the packed bytes of {m.name} differ from the tensor; nothing was sent "
                                "(a packing fault: report it)")
    return bucket.checksums()


def build_sglang_emitter(ws: WeightSync, engine: Engine, endpoint: Endpoint) -> SGLangEmitter:
    """The SGLang emitter to the server at `endpoint`."""
    log_route(endpoint.url, "inside SGLang's HTTP requests (/update_weights_from_tensor, /load_lora_adapter_"
              "from_tensors): the bytes from a CPU trainer, CUDA IPC handles from a GPU one")
    client = SGLangClient(endpoint.url, api_key=endpoint.api_key.value, timeout_s=ws.timeout_s, retries=ws.retries,
                          admin_api_key=engine.admin_api_key)
    return SGLangEmitter(client, keep_versions=ws.keep_versions, pause_mode=engine.pause_mode,
                         bucket_bytes=ws.bucket_mb << 20)


# titan_lora attaches to a running server: no launcher.
SGLANG = EngineKind("sglang", build_sglang_emitter, sglang_rollouts, check_targets=check_fused_targets)
