"""The `/titan/*` transfer routes inside vLLM's OpenAI server: INFO, BUCKET, BASE, UNLOAD, BASE_DIGESTS and
BASE_VERIFIED (the base is verified instead of pushed), ADAPTER_FROM_PATH (the `vllm-disk` baseline:
vLLM's own loader reads a PEFT directory), and EPISODE and DELETE_EPISODE (the episodes `episode_capture`
records, kept in `episodes`).

Same requests and acks as the receiver's. Every engine call is a `collective_rpc` to the worker
extension (`vllm_ext`) of every worker of every data-parallel engine core (`vllm_compat.collective_rpc_all`),
whose replies must agree; each core runs it between two engine steps, so requests keep decoding while a
version installs. A committed version is registered with the OpenAI layer under
its versioned name (`AdapterTable` keeps the alias and the leases); an unload waits, bounded, until no
request holds the version, then drops it from the OpenAI layer before the worker forgets it.
"""

from __future__ import annotations

import asyncio
import math
import os
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from titan_lora.engines import core_activity
from titan_lora.engines import vllm_compat as compat
from titan_lora.engines.adapter_table import AdapterTable
from titan_lora.engines.episode_store import EpisodeLimits, EpisodeStore
from titan_lora.transfer import protocol
from titan_lora.transfer.buckets import LayoutCache
from titan_lora.transfer.episodes import check_episode_id
from titan_lora.transfer.errors import check_name

REPLACE_TIMEOUT_S = 30.0
DEFAULT_LIVE_TIMEOUT_S = 10.0


class TitanService:
    """The transfer routes' behaviour over one AsyncLLM (`engine_client`) and its OpenAI model table."""

    def __init__(self, engine_client: Any, models: Any, model: str, limits: dict) -> None:
        self.engine_client = engine_client
        self.models = models  # vLLM's OpenAIServingModels: what /v1/* requests may name
        self.model = model
        self.limits = limits  # fixed at start: INFO (health checks, replica probes) makes no engine call
        self.incarnation = uuid.uuid4().hex
        self.nonce = os.environ.get(protocol.NONCE_ENV, "")
        self.base_version: int | None = None
        self.table = AdapterTable()
        self.episodes = EpisodeStore(EpisodeLimits.from_env(os.environ))
        # The bucket layouts the workers hold, kept as each worker's `LayoutCache` keeps them (same checks,
        # same bound, same requests in the same order), so that one they dropped is answered 409 here.
        self._layouts = LayoutCache()

    @classmethod
    async def start(cls, engine_client: Any, models: Any, model: str) -> TitanService:
        """The service, with the engine's LoRA limits read once."""
        limits = agreed("titan_lora_info", await compat.collective_rpc_all(engine_client, "titan_lora_info", None, ()))
        return cls(engine_client, models, model, limits)

    async def rpc(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """`method` on the worker extension of every worker of every data-parallel rank; their common
        answer (`agreed`)."""
        return agreed(method, await compat.collective_rpc_all(self.engine_client, method, timeout_s, args))

    async def info(self, _: dict) -> dict:
        """Identity, base state, live adapters, the alias of each, requests in flight and LoRA limits."""
        return {**protocol.incarnation_fields(self.incarnation, self.base_version), "nonce": self.nonce,
                "model": self.model, "adapters": self.table.names(),
                "aliases": self.table.aliases(), "in_flight": self.table.in_flight(),
                "episodes": self.episodes.stats(), **self.limits}

    async def live(self, req: dict) -> dict:
        """A no-op `collective_rpc` to every worker of every engine core, within `timeout_s` (504 past it):
        INFO is answered by this API server alone and cannot tell a wedged engine core or worker. On CPU,
        a core that missed the bound while computing (one long step) answers live with `busy_s`."""
        timeout_s = float(req.get("timeout_s", DEFAULT_LIVE_TIMEOUT_S))
        procs = core_activity.engine_processes() if compat.is_cpu() else []
        before = core_activity.CpuSample.now(procs)
        try:
            await asyncio.wait_for(self.rpc("titan_ping", timeout_s=timeout_s), timeout_s)
        except asyncio.TimeoutError:
            shares = core_activity.busy_shares(before, core_activity.CpuSample.now(procs))
            if core_activity.were_busy(shares):
                return {"live": True, "incarnation": self.incarnation, "busy_s": timeout_s,
                        "cpu_shares": sorted(round(x, 3) for x in shares.values())}
            why = (": it is wedged (the API server is up), or one engine step outlasts that bound: then raise "
                   "[weight_sync] health_timeout_s") if not procs else (
                   " and its processes hardly computed or waited for a core meanwhile (CPU demand / wait: "
                   f"{', '.join(f'{x:.2f}' for x in sorted(shares.values()))}): it is wedged (the API server is up)")
            raise TimeoutError(f"the engine core or a worker did not answer a no-op collective_rpc within "
                               f"{timeout_s:g} s{why}") from None
        return {"live": True, "incarnation": self.incarnation}

    async def bucket(self, req: dict) -> dict:
        """Copy one bucket out of the trainer's buffer (the ack frees it); an adapter's last bucket
        carries its commit, installed in the same engine call."""
        layout, header = req["layout"], req.get("header")
        # vLLM's RPC reports a worker's exception as a plain message: the layout checks (its id, 409 for
        # an unknown one) are made here, where they can still answer 400 or 409.
        self._layouts.resolve(layout, header)
        args = (req["transfer_id"], req["segment"], layout, header)
        if "commit" in req and "adapters" in req["commit"]:
            ack = await self._commit_set(req["commit"]["adapters"], lambda installs: self.rpc(
                "titan_receive_and_commit_set", *args, req.get("checksum"), installs))
        elif "commit" in req:
            ack = await self._commit(req["commit"], lambda lora_id, name, peft_config: self.rpc(
                "titan_receive_and_commit", *args, req.get("checksum"), lora_id, name, peft_config))
        else:
            ack = await self.rpc("titan_receive_bucket", *args, req.get("kind", "adapter"), req.get("checksum"))
        return ack

    async def _free_name(self, name: str) -> None:
        """Unload `name` if it is live (a resumed trainer re-sends its last version); refuse while
        requests still hold it."""
        if self.table.get(name) is None:
            return
        reply = await self.unload({"name": name, "timeout_s": REPLACE_TIMEOUT_S})
        if not reply["unloaded"]:
            raise RuntimeError(f"adapter {name!r} cannot be replaced: {reply['in_flight']} requests "
                               f"still use it after {REPLACE_TIMEOUT_S:g} s; send it under a new "
                               "versioned name or retry when they finish")

    async def _commit(self, commit: dict, install: Callable[[int, str, dict], Awaitable[dict]]) -> dict:
        """Install an adapter as `commit["name"]` through `install(lora_id, name, peft_config)`, then
        serve it under that name (and its alias)."""
        name, version = check_name(commit["name"]), int(commit["version"])
        await self._free_name(name)
        lora_id = compat.new_lora_id(self.models)
        ack = await install(lora_id, name, commit["peft_config"])
        self.table.add(name, version, lora_id)
        compat.serve_adapter(self.models, name, lora_id)
        return {**ack, "commit": {**ack["commit"], "name": name, "version": version,
                                  **protocol.incarnation_fields(self.incarnation, self.base_version)}}

    async def _commit_set(self, parts: list[dict], install: Callable[[list[list]], Awaitable[dict]]) -> dict:
        """Install several adapters sent together through `install([[lora_id, name, peft_config], ...])`, then
        serve each under its name (and alias)."""
        names = [check_name(part["name"]) for part in parts]
        if len(set(names)) != len(names):
            raise ValueError(f"adapters committed together must have distinct names, got {names}")
        for name in names:
            await self._free_name(name)
        ids = [compat.new_lora_id(self.models) for _ in parts]
        ack = await install([[lora_id, name, part["peft_config"]] for lora_id, name, part in zip(ids, names, parts)])
        installed = []
        for lora_id, name, part, size in zip(ids, names, parts, ack["commit"]["adapters"], strict=True):
            self.table.add(name, int(part["version"]), lora_id)
            compat.serve_adapter(self.models, name, lora_id)
            installed.append({**size, "name": name, "version": int(part["version"])})
        return {**ack, "commit": {**ack["commit"], "adapters": installed,
                                  **protocol.incarnation_fields(self.incarnation, self.base_version)}}

    async def adapter_from_path(self, req: dict) -> dict:
        """Load the PEFT directory `path` with vLLM's own loader as adapter `name` (the baseline), then
        serve it like a bucket-installed version; the ack counts the tensors and bytes of its file."""
        name, version, path = check_name(req["name"]), int(req["version"]), str(req["path"])
        weights = os.path.join(path, "adapter_model.safetensors")
        if not os.path.isfile(weights):
            raise ValueError(f"{weights} does not exist: the engine must see the trainer's disk_dir")
        await self._free_name(name)
        lora_id = compat.new_lora_id(self.models)
        await self.engine_client.add_lora(compat.LoRARequest(name, lora_id, path))
        self.table.add(name, version, lora_id)
        compat.serve_adapter(self.models, name, lora_id, path)
        return {**describe_safetensors(weights), "name": name, "version": version}

    async def episode(self, req: dict) -> dict:
        """The record of episode `episode_id` (404 when not held: `UnknownEpisode` says why)."""
        return self.episodes.fetch(check_episode_id(req.get("episode_id"))).to_json()

    async def delete_episode(self, req: dict) -> dict:
        """Drop episode `episode_id`; whether it was held."""
        return {"deleted": self.episodes.delete(check_episode_id(req.get("episode_id")))}

    async def base(self, req: dict) -> dict:
        """Install the staged transfer as the base weights; cached KV came from the old ones."""
        ack = await self.rpc("titan_commit_base", req["transfer_id"], bool(req.get("complete_from_disk")))
        await self.engine_client.reset_prefix_cache()
        self.base_version = req["version"]
        return {**ack, "version": req["version"]}

    async def base_digests(self, _: dict) -> dict:
        """The digests of the base tensors the workers loaded, and their dtype (every worker agrees)."""
        return await self.rpc("titan_base_digests")

    async def base_verified(self, req: dict) -> dict:
        """The trainer verified the base this engine loaded itself: it is ours from now on."""
        self.base_version = int(req["version"])
        return {"version": self.base_version, **protocol.incarnation_fields(self.incarnation, self.base_version)}

    async def unload(self, req: dict) -> dict:
        """Retire `name` once no request holds it, waiting at most `timeout_s`."""
        name = req["name"]
        if self.table.get(name) is None:
            return {"unloaded": True}
        drained = await self.table.wait_unused(name, float(req.get("timeout_s", 10)))
        # From here to the removal there is no await: no request can take a lease in between.
        served = self.table.remove(name) if drained else None
        if served is None:
            if self.table.get(name) is None:  # another unload took it meanwhile
                return {"unloaded": True}
            return {"unloaded": False, "in_flight": self.table.in_flight().get(name, 0)}
        compat.unserve_adapter(self.models, name)
        await self.rpc("titan_remove_adapter", served.lora_id)
        return {"unloaded": True}

    async def release(self, timeout_s: float) -> int:
        """Unmap every trainer buffer in every worker (at shutdown); how many were mapped, in all."""
        return sum(await compat.collective_rpc_all(self.engine_client, "titan_release_buffers", timeout_s, ()))


def describe_safetensors(path: str) -> dict:
    """Tensor count and bytes of a safetensors file, read from its header."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        slices = [f.get_slice(k) for k in f.keys()]
        width = {"F32": 4, "BF16": 2, "F16": 2}
        return {"tensors": len(slices),
                "bytes": sum(math.prod(s.get_shape()) * width[s.get_dtype()] for s in slices)}


def _without_timings(reply: Any) -> Any:
    """`reply` with every `*_ms` entry dropped (each worker times its own work)."""
    if isinstance(reply, dict):
        return {k: _without_timings(v) for k, v in reply.items() if not k.endswith("_ms")}
    return reply


def agreed(method: str, replies: list[Any]) -> Any:
    """The first reply, once every worker's (every data-parallel rank's) reply says the same, timings
    aside: a rank that installed other bytes, counts or versions fails the call instead of hiding behind
    rank 0's ack."""
    if not replies:
        raise RuntimeError(f"{method}: no worker answered")
    first = _without_timings(replies[0])
    for rank, reply in enumerate(replies[1:], start=1):
        if _without_timings(reply) != first:
            raise RuntimeError(f"{method}: worker {rank} answered {reply!r}, worker 0 {replies[0]!r}; the "
                               "engine's workers (data-parallel ranks) disagree")
    return replies[0]
