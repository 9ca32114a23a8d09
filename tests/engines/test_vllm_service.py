"""The vLLM engine process's loop and service against a scripted engine (no vLLM model): a failed step
does not wedge the engine, deadlines abort what still runs, and the adapter table never orphans an id."""

from __future__ import annotations

import dataclasses
import threading
import time
from http.server import ThreadingHTTPServer

import pytest
from dist_helpers import free_port

from titan_lora.clients.http import JsonClient
from titan_lora.clients.rollout import VLLMRolloutClient
from titan_lora.engines.http_server import make_handler
from titan_lora.engines.vllm_loop import EngineLoop
from titan_lora.engines.vllm_server import EngineService, parse_args
from titan_lora.transfer.errors import TransferError

POISON = [666]  # a prompt the scripted engine cannot step: every step fails while it is scheduled
STUCK = [777]  # a prompt that never finishes


@dataclasses.dataclass
class _Out:
    request_id: str
    finished: bool = True


class ScriptedEngine:
    """vLLM's LLMEngine surface used by EngineLoop: requests finish at the next step."""

    def __init__(self) -> None:
        self.live: dict[str, list[int]] = {}
        self.aborted: list[str] = []

    def add_request(self, request_id: str, prompt: dict, params: object, lora_request: object = None) -> None:
        self.live[request_id] = prompt["prompt_token_ids"]

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def step(self) -> list[_Out]:
        if POISON in self.live.values():
            raise RuntimeError("step failed")
        time.sleep(0.005)
        done = [rid for rid, ids in self.live.items() if ids != STUCK]
        for rid in done:
            del self.live[rid]
        return [_Out(rid) for rid in done]

    def abort_request(self, request_ids: list[str], internal: bool = False) -> None:
        self.aborted += request_ids
        for rid in request_ids:
            self.live.pop(rid, None)


class ScriptedLLM:
    def __init__(self) -> None:
        self.llm_engine = ScriptedEngine()
        self.installed: set[int] = set()  # LoRA ids the worker holds

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        if method == "titan_lora_info":
            return [{"max_lora_rank": 8, "max_loras": 2, "max_cpu_loras": 4, "target_modules": ["q_proj"]}]
        if method == "titan_commit_adapter":
            self.installed.add(args[1])
            return [{"tensors": 2, "bytes": 64}]
        if method == "titan_remove_adapter":
            self.installed.discard(args[0])
            return [True]
        raise AssertionError(method)


@pytest.fixture
def loop():
    engine_loop = EngineLoop(ScriptedLLM())
    yield engine_loop
    engine_loop.stop()


def test_a_failed_step_aborts_its_requests_and_the_engine_keeps_serving(loop) -> None:
    with pytest.raises(RuntimeError, match="step failed"):
        loop.generate([POISON, [1, 2]], None, None, timeout_s=10)
    assert len(loop.llm.llm_engine.aborted) == 2 and not loop.llm.llm_engine.live
    outs = loop.generate([[3, 4]], None, None, timeout_s=10)  # before the fix: the poison failed it too
    assert len(outs) == 1 and outs[0].finished


def test_requests_past_their_deadline_are_aborted(loop) -> None:
    with pytest.raises(TimeoutError, match="timeout_s=0.2"):
        loop.generate([STUCK, [1]], None, None, timeout_s=0.2)
    engine = loop.llm.llm_engine
    assert len(engine.aborted) == 2 and not engine.live, "the stuck request is still running in the engine"


def _commit(service: EngineService, name: str) -> dict:
    return service.adapter({"transfer_id": "t", "name": name, "version": 1, "peft_config": {}})


def test_replacing_a_busy_adapter_is_refused_and_orphans_no_id(loop, monkeypatch) -> None:
    service = EngineService(loop, "m")
    _commit(service, "policy-v1")
    monkeypatch.setattr(loop, "wait_unused", lambda name, timeout_s: False)
    with loop.using("policy-v1", 1), pytest.raises(RuntimeError, match="cannot be replaced"):
        _commit(service, "policy-v1")
    assert loop.llm.installed == set(service.adapters.values()) == {1}


def test_replacing_an_idle_adapter_frees_its_old_id(loop) -> None:
    service = EngineService(loop, "m")
    _commit(service, "policy-v1")
    _commit(service, "policy-v1")
    assert loop.llm.installed == set(service.adapters.values()) == {2}


def test_adapter_names_with_path_characters_and_loaded_names_are_refused(loop) -> None:
    service = EngineService(loop, "m")
    with pytest.raises(ValueError, match="adapter name"):
        _commit(service, "../x")
    with pytest.raises(ValueError, match="adapter name"):
        service.adapter_from_path({"name": ".hidden", "path": "/tmp", "version": 1})
    _commit(service, "policy-v1")
    with pytest.raises(ValueError, match="already loaded"):
        service.adapter_from_path({"name": "policy-v1", "path": "/tmp", "version": 1})
    assert loop.llm.installed == {1} and service.adapters == {"policy-v1": 1}


def test_an_adapter_in_use_is_not_unloaded(loop) -> None:
    service = EngineService(loop, "m")
    _commit(service, "policy-v1")
    with loop.using("policy-v1", 1):
        assert service.unload({"name": "policy-v1", "timeout_s": 0.05}) == {"unloaded": False, "in_flight": 1}
    assert service.unload({"name": "policy-v1", "timeout_s": 0.05}) == {"unloaded": True}
    assert loop.llm.installed == set()


def test_generate_uses_the_body_deadline_or_the_engine_default(loop, monkeypatch) -> None:
    seen: list[float] = []
    monkeypatch.setattr(loop, "generate",
                        lambda prompts, params, lora, timeout_s: seen.append(timeout_s) or [])
    service = EngineService(loop, "m", request_timeout_s=123.0)
    service.generate({"prompts": [], "max_tokens": 1, "timeout_s": 5})
    service.generate({"prompts": [], "max_tokens": 1})
    assert 4 < seen[0] <= 5 and 122 < seen[1] <= 123


def test_the_rollout_client_sends_its_timeout_and_waits_a_little_longer() -> None:
    calls: list[tuple] = []

    class Client:
        def post(self, route: str, body: dict, timeout_s: float | None = None) -> dict:
            calls.append((route, body["timeout_s"], timeout_s))
            return {"logprobs": [[-1.0]]}

    assert VLLMRolloutClient(Client(), timeout_s=42.0).score([[1, 2]], None) == [[-1.0]]
    assert calls == [("/titan/score", 42.0, 52.0)]
    with pytest.raises(ValueError, match="rollout_timeout_s"):
        VLLMRolloutClient(Client(), timeout_s=0)



def test_a_deadline_reaches_the_client_as_http_504() -> None:
    def generate(_: dict) -> dict:
        raise TimeoutError("2 requests did not finish within timeout_s=1; they were aborted")

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), make_handler({"generate": generate}, ""))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = JsonClient(f"http://127.0.0.1:{server.server_address[1]}")
        with pytest.raises(TransferError, match="HTTP 504.*aborted"):
            VLLMRolloutClient(client, timeout_s=1).generate([[1]], None, 1, 1.0, None, [])
    finally:
        server.shutdown()
        server.server_close()


def test_info_echoes_the_engine_nonce_from_the_environment(loop, monkeypatch) -> None:
    monkeypatch.setenv("TITAN_LORA_ENGINE_NONCE", "abc123")
    assert EngineService(loop, "m").info({})["nonce"] == "abc123"
    monkeypatch.delenv("TITAN_LORA_ENGINE_NONCE")
    assert EngineService(loop, "m").info({})["nonce"] == ""


def test_the_engine_reads_its_api_key_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("TITAN_LORA_API_KEY", "from-env")
    assert parse_args(["--model", "m"]).api_key == "from-env"
