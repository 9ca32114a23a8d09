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
import enum
import hashlib
import io
import json
import logging
import math
import pickle
import re
import sys
import time
import types
import uuid
from collections.abc import Iterator, Mapping, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's reducers on ForkingPickler)
from torch.multiprocessing import reductions

from titan_lora.clients.base import AdapterPayload, BaseTensors, Endpoint, base_items
from titan_lora.clients.kinds import EngineKind
from titan_lora.clients.sglang_api import (
    LoadLoRAAdapterFromTensorsReqInput,
    ServerInfo,
    SGLangClient,
    SGLangTimeout,
    UpdateWeightsFromTensorReqInput,
)
from titan_lora.transfer.buckets import Entry, bucket_size, pack, plan_buckets, stream_buckets
from titan_lora.transfer.errors import EngineWeightsLost, TransferError
from titan_lora.transfer.protocol import Ack, EngineLimits

if TYPE_CHECKING:
    from titan_lora.config import Engine, WeightSync

logger = logging.getLogger(__name__)

FLATTENED_BUCKET = "flattened_bucket"
_CUDA_DEVICE_ARG = 6  # index of the device in rebuild_cuda_tensor's args (sglang/srt/utils/patch_torch.py)
# SGLang fuses these projections: a server target covers its whole group (sglang/srt/lora/utils.py).
_FUSED = ({"q_proj", "k_proj", "v_proj", "qkv_proj"}, {"gate_proj", "up_proj", "gate_up_proj"})
_LORA_WEIGHT = re.compile(r"\.([^.]+)\.lora_(?:A|B|embedding_A|embedding_B)(?:\.weight)?$")


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


# ---- adapter config and server limits ------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, enum.Enum):
        return value.value
    raise TypeError(f"adapter_config value {value!r} is not JSON-serializable")


def sglang_adapter_config(peft_config: Mapping[str, Any]) -> dict[str, Any]:
    """The adapter_config to send: JSON-clean, with rsLoRA folded into `lora_alpha`.

    SGLang 0.5.23 reads only r, lora_alpha, target_modules and use_dora, and scales by lora_alpha / r
    (sglang/srt/lora/lora.py): it would serve an rsLoRA adapter with the wrong scale, and silently
    drop per-module ranks/alphas and modules_to_save.
    """
    cfg = json.loads(json.dumps(dict(peft_config), default=_jsonable))
    missing = [k for k in ("r", "lora_alpha", "target_modules") if k not in cfg]
    if missing:
        raise TransferError(f"adapter_config lacks {missing}: export the PEFT LoraConfig.to_dict()")
    ignored = [k for k in ("rank_pattern", "alpha_pattern", "modules_to_save", "use_dora") if cfg.get(k)]
    if cfg.get("bias", "none") != "none":
        ignored.append(f"bias={cfg['bias']!r}")
    if ignored:
        raise TransferError(f"the adapter_config sets {ignored}, which SGLang 0.5.23 ignores or refuses; "
                           "train the adapter without them")
    if cfg.get("use_rslora"):
        cfg["lora_alpha"] = cfg["lora_alpha"] * math.sqrt(cfg["r"])  # alpha/sqrt(r) == alpha'/r
        cfg["use_rslora"] = False
    return cfg


def served_modules(targets: frozenset[str] | None) -> frozenset[str] | None:
    """HF leaf names a server with `--lora-target-modules targets` adapts; None: every linear."""
    if targets is None or "all" in targets:
        return None
    out = set(targets)
    for group in _FUSED:
        if out & group:
            out |= group
    return frozenset(out)


def adapter_modules(names: Sequence[str]) -> set[str]:
    """Leaf module names that an adapter's tensors adapt (`...q_proj.lora_A.weight` -> q_proj)."""
    found = {m.group(1) for n in names if (m := _LORA_WEIGHT.search(n))}
    if not found:
        raise TransferError(f"no LoRA tensor names in the adapter (e.g. {list(names)[:2]}); expected PEFT "
                           "names such as base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
    return found


def check_server(info: ServerInfo, url: str, keep_versions: int) -> EngineLimits:
    """EngineLimits of a server, or an error naming the SGLang flag that must change."""
    def fail(problem: str, fix: str) -> TransferError:
        return TransferError(f"SGLang at {url} {problem}: restart it with {fix}")

    if not info.enable_lora:
        raise fail("was started without LoRA", "--enable-lora --max-lora-rank R --lora-target-modules ...")
    if info.dp_size != 1:
        raise fail(f"runs dp_size={info.dp_size}, and 0.5.23 loads adapters only with one replica",
                   "--dp-size 1 (one server per replica)")
    if info.max_lora_rank is None or info.lora_target_modules is None:
        raise fail("did not state its LoRA rank and targets (they were inferred from --lora-paths)",
                   "--max-lora-rank R --lora-target-modules <modules|all>")
    slots = keep_versions + 1  # the retention window plus the version being loaded
    for flag, value in (("--max-loaded-loras", info.max_loaded_loras),
                        ("--max-loras-per-batch", info.max_loras_per_batch)):
        if value is not None and value < slots:
            raise fail(f"holds {flag.strip('-').replace('-', '_')}={value} adapters, fewer than "
                       f"keep_versions + 1 = {slots}",
                       f"{flag} {slots} (or lower [weight_sync] keep_versions)")
    caps = [v for v in (info.max_loaded_loras, info.max_loras_per_batch) if v is not None]
    return EngineLimits(info.max_lora_rank, min(caps), served_modules(info.lora_target_modules))


def check_adapter(limits: EngineLimits, url: str, rank: int, modules: set[str]) -> None:
    """Raise, naming the SGLang flag, if the server cannot hold an adapter of `rank` on `modules`."""
    if rank > limits.max_lora_rank:
        raise TransferError(f"SGLang at {url} serves LoRA rank <= {limits.max_lora_rank}, the adapter has "
                           f"rank {rank}: restart it with --max-lora-rank {rank}")
    missing = set() if limits.target_modules is None else modules - limits.target_modules
    if missing:
        raise TransferError(f"SGLang at {url} does not adapt {sorted(missing)} (it serves "
                           f"{sorted(limits.target_modules or [])}): restart it with --lora-target-modules "
                           f"{' '.join(sorted(modules))} (or all)")


# ---- the emitter ---------------------------------------------------------------------------------


class SGLangEmitter:
    """Trainer side of weight sync into one SGLang 0.5.23 server; only rank 0 calls it."""

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

    def _refresh(self) -> EngineLimits:
        self._info = self.client.server_info()
        self._limits = check_server(self._info, self.client.url, self._keep_versions)
        return self._limits

    def engine_limits(self) -> EngineLimits:
        """The server's LoRA limits; raises, naming the flag, if it cannot serve our retention window."""
        return self._refresh()

    def engine_incarnation(self) -> str:
        """The served weight_version: ours after send_base, the launch value after a restart."""
        return self.client.weight_version()

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
        bucket as its tensors arrive."""
        t0 = time.perf_counter()
        self._refresh()
        assert self._info is not None
        token = f"titan-lora-{self._token}-base-v{version}"
        # in_place keeps running requests and their KV, so the flush waits until they finish.
        in_place = self._pause_mode == "in_place"
        with self._paused():
            self._begin_session()
            try:
                count, nbytes = self._stream_base(tensors, version, token, in_place)
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
        self._installed = token
        return Ack(version, count, nbytes, {"base_ms": (time.perf_counter() - t0) * 1e3})

    def _stream_base(self, tensors: BaseTensors, version: int, token: str, in_place: bool) -> tuple[int, int]:
        """Send the base bucket by bucket, each packed once its tensors arrived; (tensors, bytes) sent."""
        assert self._info is not None
        count, nbytes = 0, 0
        for i, (entries, group, last) in enumerate(stream_buckets(base_items(tensors), self._bucket_bytes)):
            bucket = pack_bucket(entries, group)
            req = UpdateWeightsFromTensorReqInput(
                serialize_for_ranks(bucket.payload(), self._info.tp_size, bucket.flat.is_cuda),
                load_format=FLATTENED_BUCKET, flush_cache=last and not in_place,
                weight_version=token if last else None)  # the version flips only when complete
            res = self.client.update_weights_from_tensor(req)
            if not res.success:
                raise TransferError(f"SGLang refused base bucket {i + 1} of version {version}: {res.message}")
            count, nbytes = count + len(entries), nbytes + sum(e.nbytes for e in entries)
        return count, nbytes

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
        assert self._info is not None
        config = sglang_adapter_config(payload.peft_config)
        check_adapter(limits, self.client.url, int(config["r"]), adapter_modules(list(payload.tensors)))
        t0 = time.perf_counter()
        [entries] = plan_buckets(payload.tensors, sys.maxsize)  # one bucket: the load is all or nothing
        bucket = pack_bucket(entries, payload.tensors)
        t1 = time.perf_counter()
        req = LoadLoRAAdapterFromTensorsReqInput(
            lora_name=payload.name, config_dict=config,
            serialized_named_tensors=serialize_for_ranks(bucket.payload(), self._info.tp_size,
                                                         bucket.flat.is_cuda),
            load_format=FLATTENED_BUCKET, expected_checksums=bucket.checksums() if self._verify else None)
        t2 = time.perf_counter()
        with self._paused():
            res = self.client.load_lora_adapter_from_tensors(req)
            if not res.success and "already loaded" in res.message:
                # A stale copy under this name: an attempt that timed out on our side but finished, or a
                # previous run that reached this step. This run never published it: replace it.
                logger.warning("SGLang already holds %s; replacing it", payload.name)
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
        """Free the engine's KV cache (never its weights: in adapter mode the base must stay)."""
        self.client.release_kv_cache()

    def resume_kv_cache(self) -> None:
        """Re-allocate the KV cache after `release_kv_cache`."""
        self.client.resume_kv_cache()

    def close(self) -> None:
        """Nothing to release: the client opens one connection per request."""


def build_sglang_emitter(ws: WeightSync, engine: Engine, endpoint: Endpoint) -> SGLangEmitter:
    """The SGLang emitter to the server at `endpoint`."""
    client = SGLangClient(endpoint.url, api_key=endpoint.api_key, timeout_s=ws.timeout_s, retries=ws.retries)
    return SGLangEmitter(client, keep_versions=ws.keep_versions, pause_mode=engine.pause_mode,
                         bucket_bytes=ws.bucket_mb << 20)


# Rollouts from SGLang are not wired into the loop yet; titan_lora attaches to a running server.
SGLANG = EngineKind("sglang", build_sglang_emitter)
