"""The `/titan/*` transfer routes inside vLLM's OpenAI server: INFO, BUCKET, BASE, UNLOAD.

Same requests and acks as the standalone server's. Every engine call is a `collective_rpc` to the
worker extension (`vllm_ext`), which vLLM's engine core runs between two engine steps, so requests
keep decoding while a version installs. A committed version is registered with the OpenAI layer under
its versioned name (`AdapterTable` keeps the alias and the leases); an unload waits, bounded, until no
request holds the version, then drops it from the OpenAI layer before the worker forgets it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from titan_lora.engines import vllm_compat as compat
from titan_lora.engines.adapter_table import AdapterTable
from titan_lora.transfer import protocol
from titan_lora.transfer.buckets import UnknownLayout
from titan_lora.transfer.errors import check_name

REPLACE_TIMEOUT_S = 30.0


class TitanService:
    """The transfer routes' behaviour over one AsyncLLM (`engine_client`) and its OpenAI model table."""

    def __init__(self, engine_client: Any, models: Any, model: str, limits: dict) -> None:
        self.engine_client = engine_client
        self.models = models  # vLLM's OpenAIServingModels: what /v1/* requests may name
        self.model = model
        self.limits = limits  # fixed at start; INFO (asked before every sync) makes no engine call
        self.incarnation = uuid.uuid4().hex
        self.nonce = os.environ.get(protocol.NONCE_ENV, "")
        self.base_version: int | None = None
        self.table = AdapterTable()
        self._layouts: set[str] = set()  # bucket layouts the worker has been sent the header of

    @classmethod
    async def start(cls, engine_client: Any, models: Any, model: str) -> TitanService:
        """The service, with the engine's LoRA limits read once."""
        limits = (await engine_client.collective_rpc("titan_lora_info"))[0]
        return cls(engine_client, models, model, limits)

    async def rpc(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """`collective_rpc` to the worker extension; the first worker's answer."""
        return (await self.engine_client.collective_rpc(method, timeout=timeout_s, args=args))[0]

    async def info(self, _: dict) -> dict:
        """Identity, base state, live adapters, the alias of each, requests in flight and LoRA limits."""
        return {"incarnation": self.incarnation, "nonce": self.nonce, "model": self.model,
                "base_version": self.base_version, "adapters": self.table.names(),
                "aliases": self.table.aliases(), "in_flight": self.table.in_flight(), **self.limits}

    async def bucket(self, req: dict) -> dict:
        """Copy one bucket out of the trainer's buffer (the ack frees it); an adapter's last bucket
        carries its commit, installed in the same engine call."""
        layout, header = req["layout"], req.get("header")
        # vLLM's RPC reports a worker's exception as a plain message: the layout check is made here,
        # where it can still answer 409 (the worker learns each header with the same request).
        if header is None and layout not in self._layouts:
            raise UnknownLayout(f"unknown bucket layout {layout}")
        args = (req["transfer_id"], req["segment"], layout, header)
        if "commit" in req:
            ack = await self._commit(req["commit"], lambda lora_id, name, peft_config: self.rpc(
                "titan_receive_and_commit", *args, req.get("checksum"), lora_id, name, peft_config))
        else:
            ack = await self.rpc("titan_receive_bucket", *args, req.get("kind", "adapter"), req.get("checksum"))
        self._layouts.add(layout)
        return ack

    async def _commit(self, commit: dict, install: Callable[[int, str, dict], Awaitable[dict]]) -> dict:
        """Install an adapter as `commit["name"]` through `install(lora_id, name, peft_config)`, then
        serve it under that name (and its alias)."""
        name, version = check_name(commit["name"]), int(commit["version"])
        if self.table.get(name) is not None:  # a resumed trainer re-sends its last version
            reply = await self.unload({"name": name, "timeout_s": REPLACE_TIMEOUT_S})
            if not reply["unloaded"]:
                raise RuntimeError(f"adapter {name!r} cannot be replaced: {reply['in_flight']} requests "
                                   f"still use it after {REPLACE_TIMEOUT_S:g} s; send it under a new "
                                   "versioned name or retry when they finish")
        lora_id = compat.new_lora_id(self.models)
        ack = await install(lora_id, name, commit["peft_config"])
        self.table.add(name, version, lora_id)
        compat.serve_adapter(self.models, name, lora_id)
        return {**ack, "commit": {**ack["commit"], "name": name, "version": version}}

    async def base(self, req: dict) -> dict:
        """Install the staged transfer as the base weights; cached KV came from the old ones."""
        ack = await self.rpc("titan_commit_base", req["transfer_id"])
        await self.engine_client.reset_prefix_cache()
        self.base_version = req["version"]
        return {**ack, "version": req["version"]}

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
        """Unmap every trainer buffer in every worker (at shutdown); how many were mapped."""
        return await self.rpc("titan_release_buffers", timeout_s=timeout_s)
