"""A receiver process: the engine side of a transfer without an inference engine behind it.

    python -m titan_lora.engines.receiver --port 8012 [--device cuda:0]

It speaks the same `/titan/*` routes as the vLLM engine process for transfers (info, bucket,
adapter, base, unload): it copies every bucket out of the trainer's buffer (shared memory or CUDA
IPC) into its own storage and acknowledges what it holds. The sync benchmark measures end-to-end
latency against it, and GPU hosts with no inference engine time the train + sync step with it.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
import uuid
from http.server import ThreadingHTTPServer

import torch

from titan_lora.emitters.buckets import LayoutCache, unpack
from titan_lora.emitters.transport import BufferCache
from titan_lora.engines.http_server import make_handler

logger = logging.getLogger("titan_lora.receiver")


def _size(tensors: dict[str, torch.Tensor]) -> dict:
    return {"tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}


class ReceiverService:
    """Holds the latest base and every live adapter, as copies it owns."""

    def __init__(self, max_lora_rank: int, max_loras: int) -> None:
        self.incarnation = uuid.uuid4().hex
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras
        self.buffers = BufferCache()
        self.layouts = LayoutCache()
        self.staging: dict[str, dict[str, torch.Tensor]] = {}
        self.adapters: dict[str, dict[str, torch.Tensor]] = {}
        self.base_weights: dict[str, torch.Tensor] | None = None
        self.base_version: int | None = None
        self._lock = threading.Lock()

    def info(self, _: dict) -> dict:
        """Identity and limits (no target-module restriction: nothing is applied to a model)."""
        return {"incarnation": self.incarnation, "base_version": self.base_version, "max_lora_rank": self.max_lora_rank,
                "max_loras": self.max_loras, "target_modules": None, "adapters": sorted(self.adapters)}

    def bucket(self, req: dict) -> dict:
        """Copy one bucket out, then acknowledge it."""
        entries = self.layouts.resolve(req["layout"], req.get("header"))
        tensors = unpack(self.buffers.get(req["segment"]), entries)
        with self._lock:
            self.staging.setdefault(req["transfer_id"], {}).update(tensors)
        ack = {"tensors": len(entries), "bytes": sum(e.nbytes for e in entries)}
        if "commit" in req:  # an adapter's last bucket carries its commit
            ack["commit"] = self.adapter({**req["commit"], "transfer_id": req["transfer_id"]})
        return ack

    def _take(self, transfer_id: str) -> dict[str, torch.Tensor]:
        with self._lock:
            if transfer_id not in self.staging:
                raise ValueError(f"transfer {transfer_id!r} has no buckets")
            return self.staging.pop(transfer_id)

    def adapter(self, req: dict) -> dict:
        """Keep the staged transfer as adapter `name`."""
        started = time.perf_counter()
        tensors = self._take(req["transfer_id"])
        self.adapters[req["name"]] = tensors
        return {**_size(tensors), "name": req["name"], "version": req["version"],
                "apply_ms": (time.perf_counter() - started) * 1e3}

    def base(self, req: dict) -> dict:
        """Keep the staged transfer as the base."""
        self.base_weights = self._take(req["transfer_id"])
        self.base_version = req["version"]
        return {**_size(self.base_weights), "version": req["version"]}

    def unload(self, req: dict) -> dict:
        """Drop adapter `name`."""
        self.adapters.pop(req["name"], None)
        return {"unloaded": True}


def main(argv: list[str] | None = None) -> None:
    """Serve until killed."""
    p = argparse.ArgumentParser(description="titan_lora receiver process (no inference engine)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8012)
    p.add_argument("--device", default="", help="CUDA device to bind (cuda:N) for IPC buffers")
    p.add_argument("--max-lora-rank", type=int, default=512)
    p.add_argument("--max-loras", type=int, default=8)
    p.add_argument("--api-key", default="")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[titan_lora receiver %(asctime)s] %(message)s", datefmt="%H:%M:%S")
    if args.device:
        torch.cuda.set_device(torch.device(args.device))
    service = ReceiverService(args.max_lora_rank, args.max_loras)
    routes = {op: getattr(service, op) for op in ("info", "bucket", "base", "unload")}
    server = ThreadingHTTPServer((args.host, args.port), make_handler(routes, args.api_key))
    logger.info("receiver %s ready on http://%s:%d", service.incarnation[:8], args.host, args.port)
    server.serve_forever()


if __name__ == "__main__":
    main()
