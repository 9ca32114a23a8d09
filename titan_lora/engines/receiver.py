"""A receiver process: the engine side of a transfer without an inference engine behind it.

    python -m titan_lora.engines.receiver --port 8012 [--device cuda:0] [--frames-port N]

It speaks the same `/titan/*` routes as the vLLM engine process for transfers (info, bucket,
adapter, base, unload), and serves bucket, base and unload as frames too (`transfer.frames`; INFO
offers the port): it copies every bucket out of the trainer's buffer (shared memory, CUDA
IPC, or fetched over tcp) into its own storage and acknowledges what it holds, with the checksum of
the bytes it stored.
The sync benchmark measures end-to-end latency against it, and GPU hosts with no inference engine
time the train + sync step with it. Like the vLLM engine process it reads TITAN_LORA_API_KEY and
TITAN_LORA_ENGINE_NONCE from the environment, and honours the fault-injection variables
TITAN_LORA_FAULT_BUCKET_PAUSE_S and TITAN_LORA_FAULT_MARKER (`titan_lora.engines.transfers`).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable

import torch

from titan_lora.engines.frame_server import FrameServer
from titan_lora.engines.http_server import (
    DEFAULT_HEAD_TIMEOUT_S,
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_BODY_MB,
    DEFAULT_MAX_CONNECTIONS,
    FrontServer,
    make_handler,
)
from titan_lora.engines.transfers import BucketRequest, SlabPool, Staged, TransferStore, receive
from titan_lora.transfer import protocol
from titan_lora.transfer.buckets import LayoutCache
from titan_lora.transfer.errors import check_name
from titan_lora.transfer.frames import FRAMES_PORT
from titan_lora.transfer.transport import BufferCache

logger = logging.getLogger("titan_lora.receiver")
DEFAULT_LIVE_TIMEOUT_S = 10.0
SHUTDOWN_WAIT_S = 10.0
"""At exit, how long routes in progress may take to finish before the mappings are released anyway."""


def _on_core(route: Callable[[ReceiverService, dict], dict]) -> Callable[[ReceiverService, dict], dict]:
    """`route` run under the service's core lock (see `ReceiverService.live`)."""
    @functools.wraps(route)
    def held(self: ReceiverService, req: dict) -> dict:
        with self._core:
            return route(self, req)

    return held


class ReceiverService:
    """Holds the latest base and every live adapter, as copies it owns: slabs on `device` (None: where
    the trainer's buffer lies), pooled by layout, so that a retired adapter's slab takes a later one."""

    def __init__(self, max_lora_rank: int, max_loras: int, device: torch.device | None = None) -> None:
        self.incarnation = uuid.uuid4().hex
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras
        self.nonce = os.environ.get(protocol.NONCE_ENV, "")
        self.buffers = BufferCache()
        self.layouts = LayoutCache()
        self.slabs = SlabPool(device, kept_per_layout=max_loras + 1)
        self.base_slabs = SlabPool(device, kept_per_layout=0)  # the base comes once: nothing to reuse
        self.transfers = TransferStore(on_drop=self._give_back)
        self.adapters: dict[str, Staged] = {}
        self._base: Staged | None = None
        self.base_version: int | None = None
        self.frames_port: int | None = None  # set once the frame server listens
        self._lock = threading.Lock()
        # The receiver's "engine core": every transfer route runs under it, one at a time (the trainer
        # posts one bucket at a time anyway), and LIVE takes it too, so a wedged transfer fails LIVE while
        # INFO, answered from memory, still answers.
        self._core = threading.Lock()

    def info(self, _: dict) -> dict:
        """Identity and limits (no target-module restriction: nothing is applied to a model), and the
        frames port where one is served."""
        frames = {} if self.frames_port is None else {FRAMES_PORT: self.frames_port}
        return {**protocol.incarnation_fields(self.incarnation, self.base_version), "nonce": self.nonce,
                "max_lora_rank": self.max_lora_rank, "max_loras": self.max_loras, "target_modules": None,
                "adapters": sorted(self.adapters), **frames}

    def base_digests(self, _: dict) -> dict:
        """No record: the receiver loads no checkpoint of its own, so the trainer sends it the whole base."""
        return {"dtype": None, "digests": {}}

    def live(self, req: dict) -> dict:
        """A no-op on the transfer path: answers once no transfer holds it, or 504 after `timeout_s`."""
        timeout_s = float(req.get("timeout_s", DEFAULT_LIVE_TIMEOUT_S))
        if not self._core.acquire(timeout=max(timeout_s, 0.0)):
            raise TimeoutError(f"the receiver's transfer path has been busy for over {timeout_s:g} s: a "
                               "transfer is stuck in it")
        self._core.release()
        return {"live": True, "incarnation": self.incarnation}

    def _pool(self, kind: str) -> SlabPool:
        return self.base_slabs if kind == "base" else self.slabs

    def _give_back(self, staged: Staged) -> None:
        self._pool(staged.kind).give_all(staged)

    @property
    def base_weights(self) -> dict[str, torch.Tensor] | None:
        """The base's tensors by HF name, or None before the first base."""
        return None if self._base is None else self._base.tensors

    def adapter_tensors(self, name: str) -> dict[str, torch.Tensor]:
        """Adapter `name`'s tensors as this process holds them (views of its slabs)."""
        return self.adapters[name].tensors

    @_on_core
    def bucket(self, req: dict) -> dict:
        """Copy one bucket out, check its checksum, then acknowledge it (`copy_ms`: this process's time)."""
        started = time.perf_counter()
        bucket = BucketRequest.parse(req)
        entries = self.layouts.resolve(bucket.layout, req.get("header"))
        ack = receive(self.buffers, self._pool(bucket.kind), self.transfers, bucket, entries)
        ack["copy_ms"] = (time.perf_counter() - started) * 1e3
        if "commit" in req:  # an adapter's last bucket carries its commit
            ack["commit"] = self._keep_adapter({**req["commit"], "transfer_id": req["transfer_id"]})
        return ack

    @_on_core
    def adapter(self, req: dict) -> dict:
        """Keep the staged transfer as adapter `name`."""
        return self._keep_adapter(req)

    def _keep_adapter(self, req: dict) -> dict:
        """Keep the staged transfer as adapter `name`, or as each of `adapters` (several sent together)."""
        started = time.perf_counter()
        if "adapters" in req:
            parts = req["adapters"]
            names = [check_name(part["name"]) for part in parts]
            if len(set(names)) != len(names):
                raise ValueError(f"adapters committed together must have distinct names, got {names}")
            kept = self.transfers.take_set(req["transfer_id"], len(parts))
            acks = [{**self._keep(name, staged), "name": name, "version": part["version"]}
                    for name, staged, part in zip(names, kept, parts)]
            commit = {"adapters": acks}
        else:
            name = check_name(req["name"])
            staged = self.transfers.take(req["transfer_id"])
            commit = {**self._keep(name, staged), "name": req["name"], "version": req["version"]}
        return {**commit, **protocol.incarnation_fields(self.incarnation, self.base_version),
                "apply_ms": (time.perf_counter() - started) * 1e3}

    def _keep(self, name: str, staged: Staged) -> dict:
        """Hold `staged` as adapter `name` (a version of that name held before is dropped); its size."""
        with self._lock:
            replaced, self.adapters[name] = self.adapters.get(name), staged
        if replaced is not None:
            self._give_back(replaced)
        return staged.size()

    @_on_core
    def base(self, req: dict) -> dict:
        """Keep the staged transfer as the base."""
        staged = self.transfers.take(req["transfer_id"])
        self._base, self.base_version = staged, req["version"]
        return {**staged.size(), "version": req["version"]}

    @_on_core
    def unload(self, req: dict) -> dict:
        """Drop adapter `name`."""
        with self._lock:
            dropped = self.adapters.pop(req["name"], None)
        if dropped is not None:
            self._give_back(dropped)  # nothing reads its views now: the next adapter reuses the slab
        return {"unloaded": True}


def build_server(argv: list[str] | None = None, frames: bool = False,
                 ) -> tuple[FrontServer, ReceiverService, FrameServer | None]:
    """The receiver's HTTP server (bound, not yet serving), its service and, with `frames` where
    `--frames-port` allows, its frame server (serving from now on), from command-line options."""
    p = argparse.ArgumentParser(description="titan_lora receiver process (no inference engine)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8012)
    p.add_argument("--device", default="", help="CUDA device to bind (cuda:N) for IPC buffers")
    p.add_argument("--max-lora-rank", type=int, default=512)
    p.add_argument("--max-loras", type=int, default=8, help="adapter slots (versions held at once)")
    p.add_argument("--api-key", default=os.environ.get(protocol.API_KEY_ENV, ""),
                   help="for manual use; a launcher passes TITAN_LORA_API_KEY in the environment")
    p.add_argument("--max-body-mb", type=int, default=DEFAULT_MAX_BODY_MB,
                   help="largest request body accepted")
    p.add_argument("--frames-port", type=int, default=0,
                   help="port of the framed transfer routes, on --host (0: any free one; -1: HTTP only)")
    p.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                   help="connections served at once, per port (one more is answered 503 and closed)")
    p.add_argument("--peer-deadline-s", type=float, default=DEFAULT_HEAD_TIMEOUT_S,
                   help="seconds a connection has to send a request's line and headers (HTTP) or to "
                        "complete its greeting (frames)")
    p.add_argument("--idle-timeout-s", type=float, default=DEFAULT_IDLE_TIMEOUT_S,
                   help="a kept connection with no request for this long is closed")
    args = p.parse_args(argv)
    device = torch.device(args.device) if args.device else None
    if device is not None:
        if device.index is not None:  # "cuda" alone: the current device (torch 2.11 refuses to set it)
            torch.cuda.set_device(device)
        device = torch.device("cuda", torch.cuda.current_device())
    service = ReceiverService(args.max_lora_rank, args.max_loras, device)
    served = (*protocol.TRANSFER_ROUTES, protocol.BASE_DIGESTS)  # digests: none (it loads no checkpoint)
    routes = {op: _on_device(getattr(service, op), device) for op in served}
    handler = make_handler(routes, args.api_key, args.max_body_mb * 2**20, args.peer_deadline_s,
                           args.idle_timeout_s)
    server = FrontServer((args.host, args.port), handler, args.max_connections)
    framed = None
    if frames and args.frames_port >= 0:
        framed = FrameServer((args.host, args.frames_port), routes, args.api_key, args.max_body_mb * 2**20,
                             service.incarnation, args.max_connections, args.peer_deadline_s, args.idle_timeout_s)
        framed.start()
        service.frames_port = framed.port
    return server, service, framed


def _on_device(route: Callable[[dict], dict], device: torch.device | None) -> Callable[[dict], dict]:
    """`route` run with `device` current: the current CUDA device is per thread, and each request has its
    own (an NCCL group formed on another GPU than its buffers fails with "Duplicate GPU detected")."""
    if device is None or device.type != "cuda":
        return route
    return functools.wraps(route)(lambda body: _call_on(device, route, body))


def _call_on(device: torch.device, route: Callable[[dict], dict], body: dict) -> dict:
    # Set once per thread, not entered and left per request: nothing else runs on the server's threads,
    # and a device context costs a sync's hot path tens of microseconds.
    if torch.cuda.current_device() != device.index:
        torch.cuda.set_device(device)
    return route(body)


def main(argv: list[str] | None = None) -> None:
    """Serve until killed."""
    logging.basicConfig(level=logging.INFO, format="[titan_lora receiver %(asctime)s] %(message)s",
                        datefmt="%H:%M:%S")
    server, service, framed = build_server(argv, frames=True)
    host, port = server.server_address[:2]
    logger.info("receiver %s ready on http://%s:%d (frames port %s)", service.incarnation[:8], host, port,
                service.frames_port)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # unwind, so the finally below runs
    try:
        server.serve_forever()
    finally:
        shut_down(server, service, framed)
        logger.info("receiver %s stopped; mappings released", service.incarnation[:8])


def shut_down(server: FrontServer, service: ReceiverService, framed: FrameServer | None,
              wait_s: float = SHUTDOWN_WAIT_S) -> None:
    """Stop both fronts, close their live connections (a kept one would be served on), let routes in
    progress finish (at most `wait_s`), then release every mapping: the trainer's CUDA IPC ref counters
    drop only when we unmap. The core lock stays held: no route maps a buffer after the release."""
    fronts = [front for front in (framed, server) if front is not None]
    for front in fronts:
        front.shutdown()  # returns at once for the HTTP server, whose serve_forever already ended
        front.server_close()
    closed = sum(front.close_connections(wait_s) for front in fronts)
    if not service._core.acquire(timeout=wait_s):
        logger.warning("a transfer still runs after %g s; releasing the mappings under it", wait_s)
    service.buffers.clear()
    logger.info("closed %d live connections before releasing the mappings", closed)


if __name__ == "__main__":
    main()
