"""The OpenAI rollout client's waits against a local server that stalls like a wedged engine core: an
`interrupt` (the watchdog found the engine wedged) ends every waiting call at once with EngineHung, and a
call after it goes through on fresh connections. A timeout is an engine hang too (the syncer recovers).
Each request carries the key of the engine's current incarnation (an embedded engine gets a fresh one at
every start)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from http_helpers import answer_json, completion_of, serving

from titan_lora.clients.http import ApiKey
from titan_lora.clients.openai_rollout import KEEPALIVE_EXPIRY_S, OpenAIRolloutClient, engine_failure
from titan_lora.transfer.errors import EngineHung, EngineUnreachable, TransferError


class Completions(ThreadingHTTPServer):
    """`/v1/completions` that answers token [7] per choice, after `stall` is set (when there is one)."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.stall: threading.Event | None = None
        self.requests = 0
        self.keys: list[str] = []  # the Authorization header of each request

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # /v1/models
        self.server.keys.append(self.headers.get("Authorization", ""))
        answer_json(self, {"object": "list",
                           "data": [{"id": "base", "object": "model", "created": 0, "owned_by": "x"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests += 1
        self.server.keys.append(self.headers.get("Authorization", ""))
        if self.server.stall is not None and not self.server.stall.wait(30):
            return
        answer_json(self, completion_of(body))

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server() -> Iterator[Completions]:
    srv = Completions()
    with serving(srv, lambda: srv.stall is not None and srv.stall.set()):
        yield srv


def test_interrupt_ends_every_waiting_call_at_once_and_later_calls_go_through(server: Completions) -> None:
    server.stall = threading.Event()
    client = OpenAIRolloutClient(server.url, timeout_s=60.0)
    raised: list[BaseException] = []

    def sample() -> None:
        try:
            client.generate([[1, 2]] * 4 + [[3]] * 4, "policy-v1", 4, 1.0, 0, [])
        except BaseException as err:  # noqa: BLE001 (checked below)
            raised.append(err)

    callers = [threading.Thread(target=sample) for _ in range(2)]
    for c in callers:
        c.start()
    while server.requests < 4:  # two groups from each caller in flight
        time.sleep(0.01)
    started = time.monotonic()
    client.interrupt("the engine core did not answer LIVE")
    for c in callers:
        c.join(5)
    assert time.monotonic() - started < 1.0 and not any(c.is_alive() for c in callers)
    assert len(raised) == 2 and all(isinstance(e, EngineHung) for e in raised)
    assert all("abandoned: the engine core did not answer LIVE" in str(e) for e in raised)
    server.stall.set()
    server.stall = None
    out = client.generate([[1, 2]] * 2, "policy-v1", 4, 1.0, 0, [])
    assert [c.token_ids for c in out] == [[7], [7]]


def test_a_call_past_the_rollout_timeout_is_an_engine_hang(server: Completions) -> None:
    server.stall = threading.Event()
    client = OpenAIRolloutClient(server.url, timeout_s=0.5)
    with pytest.raises(EngineHung, match=r"no answer within 0.5 s \(\[weight_sync\] rollout_timeout_s\)"):
        client.generate([[1]], "policy-v1", 4, 1.0, 0, [])


def test_each_request_carries_the_key_of_the_current_incarnation(server: Completions) -> None:
    key = ApiKey("first-incarnation")
    client = OpenAIRolloutClient(server.url, key, timeout_s=10)
    client.generate([[1]], "policy-v1", 4, 1.0, 0, [])
    key.value = "second-incarnation"  # what EmbeddedEngine.start does
    client.generate([[1]], "policy-v1", 4, 1.0, 0, [])
    client.generate([[1]], None, 4, 1.0, 0, [])  # the base's name from /v1/models, then a sample
    assert server.keys[-2:] == ["Bearer second-incarnation"] * 2
    assert server.keys[:2] == ["Bearer first-incarnation", "Bearer second-incarnation"]


def test_idle_connections_expire_before_vllms_keep_alive_closes_them() -> None:
    # With no retries, reusing a connection the server is closing that instant fails the request
    # ("Connection error." in a parity probe of an async run): httpx's default expiry equals vLLM's 5 s.
    envs = pytest.importorskip("vllm.envs")  # the keep-alive of the engine we serve through
    client = OpenAIRolloutClient("http://127.0.0.1:1")
    pool = client.client._client._transport._pool  # openai's httpx.Client -> httpcore's pool
    assert client.client.max_retries == 0
    assert pool._keepalive_expiry == KEEPALIVE_EXPIRY_S < envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE / 2


def test_the_engines_failures_map_to_recoverable_errors_and_a_callers_own_4xx_does_not() -> None:
    import httpx
    import openai

    request = httpx.Request("POST", "http://engine/v1/completions")

    def status(code: int) -> openai.APIStatusError:
        cls = openai.InternalServerError if code >= 500 else openai.BadRequestError
        return cls(f"Error code: {code}", body=None, response=httpx.Response(code, request=request))

    hung = engine_failure(openai.APITimeoutError(request=request), "http://engine", "within 2 s")
    assert isinstance(hung, EngineHung) and str(hung) == "http://engine: no answer within 2 s"
    lost = engine_failure(openai.APIConnectionError(request=request), "http://engine")
    assert isinstance(lost, EngineUnreachable) and str(lost) == "http://engine: Connection error."
    dead = engine_failure(status(500), "http://engine")
    assert type(dead) is TransferError and str(dead) == "http://engine failed with HTTP 500: Error code: 500"
    assert engine_failure(status(400), "http://engine") is None, "a bad request is the caller's, not the engine's"
    assert engine_failure(KeyError("x"), "http://engine") is None
