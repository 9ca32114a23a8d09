"""The scripted SGLang client behind the SGLang emitter's unit tests (test_sglang_units.py,
test_sglang_units_base.py, test_sglang_units_adapter.py): `Client` stands in for SGLangClient, records each
call and answers from attributes a test sets (no HTTP); `info` builds the ServerInfo it reports, `BASE` and
`adapter` are the base weights and adapter payloads those tests send, `emitter` builds the SGLangEmitter
under test and `own` picks the emitter's own log lines out of caplog. `serving` runs a one-off HTTP
handler for the tests that need a server answering one exact way.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from titan_lora.clients.base import AdapterPayload
from titan_lora.clients.sglang import SGLangEmitter
from titan_lora.clients.sglang_api import ControlResult, ServerInfo

URL = "http://sglang.test:30000"
OK = ControlResult(True, "ok")


def info(**overrides) -> ServerInfo:
    base = dict(version="0.5.23", enable_lora=True, max_lora_rank=16,
                lora_target_modules=frozenset({"q_proj", "v_proj"}), max_loaded_loras=4, max_loras_per_batch=4,
                tp_size=2, dp_size=1, enable_memory_saver=True)
    return ServerInfo(**{**base, **overrides})


class Client:
    """SGLangClient stand-in: records each call; answers from attributes the test sets."""

    url, timeout_s = URL, 42.0

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.info = info()
        self.served = "launch-version"  # the weight_version the server reports
        self.begin = [OK]
        self.end = OK
        self.update: list[ControlResult] = []
        self.load: list[ControlResult] = []
        self.unload: list[object] = []
        self.flushed = True
        self.weights = dict(BASE)  # what /get_weights_by_name reads; absent: SGLang answers None
        self.probes: list[tuple[str, int]] = []  # get_weights_by_name calls, kept out of `calls`

    def server_info(self) -> ServerInfo:
        self.calls.append(("server_info",))
        return self.info

    def weight_version(self) -> str:
        self.calls.append(("weight_version",))
        return self.served

    def begin_weight_update(self) -> ControlResult:
        self.calls.append(("begin",))
        return self.begin.pop(0) if len(self.begin) > 1 else self.begin[0]

    def end_weight_update(self) -> ControlResult:
        self.calls.append(("end",))
        return self.end

    def update_weights_from_tensor(self, req) -> ControlResult:
        self.calls.append(("update", req))
        if req.weight_version is not None:
            self.served = req.weight_version
        return self.update.pop(0) if self.update else OK

    def load_lora_adapter_from_tensors(self, req) -> ControlResult:
        self.calls.append(("load", req))
        if self.load:
            return self.load.pop(0)
        return ControlResult(True, "loaded", {req.lora_name: "x"})

    def unload_lora_adapter(self, lora_name: str, timeout_s: float) -> ControlResult:
        self.calls.append(("unload", lora_name, timeout_s))
        answer = self.unload.pop(0) if self.unload else OK
        if isinstance(answer, Exception):
            raise answer
        return answer

    def get_weights_by_name(self, name: str, truncate_size: int) -> list | None:
        self.probes.append((name, truncate_size))
        return self.weights[name][:truncate_size].tolist() if name in self.weights else None

    def pause_generation(self, mode: str) -> None:
        self.calls.append(("pause", mode))

    def continue_generation(self) -> None:
        self.calls.append(("continue",))

    def flush_cache(self, wait_idle_s: float = 0.0) -> bool:
        self.calls.append(("flush", wait_idle_s))
        return self.flushed

    def release_kv_cache(self) -> None:
        self.calls.append(("release_kv",))

    def resume_kv_cache(self) -> None:
        self.calls.append(("resume_kv",))

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


BASE = {"model.embed_tokens.weight": torch.arange(8.0).view(2, 4), "model.norm.weight": torch.ones(4)}


def adapter(name: str = "policy-v1", r: int = 8) -> AdapterPayload:
    tensors = {f"base_model.model.model.layers.0.self_attn.{m}.lora_{ab}.weight": t
               for m in ("q_proj", "v_proj") for ab, t in (("A", torch.ones(r, 4)), ("B", torch.zeros(4, r)))}
    return AdapterPayload(name, 1, tensors, {"r": r, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]})


def emitter(client: Client, **kwargs) -> SGLangEmitter:
    return SGLangEmitter(client, keep_versions=2, **kwargs)


def own(caplog: pytest.LogCaptureFixture, *markers: str) -> list[str]:
    """The emitter's log lines that carry one of `markers` (other tests' background retirers may also log)."""
    return [r.getMessage() for r in caplog.records
            if r.name == "titan_lora.clients.sglang" and any(m in r.getMessage() for m in markers)]


class Answering(BaseHTTPRequestHandler):
    """A server that answers every request with `answer(body)` as JSON and status `status`, quietly."""

    status = 200

    def answer(self, body: bytes) -> object:
        """The JSON reply to a request body."""
        raise NotImplementedError

    def _reply(self) -> None:
        data = json.dumps(self.answer(self.rfile.read(int(self.headers.get("Content-Length") or 0)))).encode()
        self.send_response(self.status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _reply

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """The URL of a local HTTP server answering with `handler`, for the duration of the block."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
