"""The router over real OpenAI rollout clients and a local `/v1/completions` that refuses a prompt over its
max model length with HTTP 400, as vLLM does: the refusal is the request's error (which request, and the
engine's reason), and no healthy replica is quarantined for it."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from http_helpers import answer_json, completion_of, serving

from titan_lora.clients.base import Endpoint
from titan_lora.clients.openai_rollout import OpenAIRolloutClient
from titan_lora.clients.replica_set import Replica, ReplicaSet
from titan_lora.clients.router import RolloutRouter
from titan_lora.config import WeightSync
from titan_lora.transfer.errors import TransferError

MAX_MODEL_LEN = 4


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if len(body["prompt"]) + body["max_tokens"] > MAX_MODEL_LEN:  # vLLM's words and status
            answer_json(self, {"object": "error", "type": "BadRequestError", "code": 400, "param": None,
                               "message": f"This model's maximum context length is {MAX_MODEL_LEN} tokens."},
                        status=400)
            return
        answer_json(self, completion_of(body))

    def log_message(self, *args) -> None:
        pass


class _Emitter:
    """What the replica set asks of an emitter here: the liveness of a replica with work in flight."""

    def check_live(self, timeout_s: float) -> None:
        pass

    def interrupt(self, reason: str) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture
def router() -> Iterator[RolloutRouter]:
    stack = contextlib.ExitStack()
    servers = [stack.enter_context(serving(ThreadingHTTPServer(("127.0.0.1", 0), _Handler))) for _ in range(3)]
    replicas = []
    for i, srv in enumerate(servers):
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        replicas.append(Replica(i, Endpoint(url), _Emitter(), OpenAIRolloutClient(url, timeout_s=10.0),
                                held={1: "policy-v1"}))
    rs = ReplicaSet(replicas, WeightSync(enabled=True, health_timeout_s=2.0))
    yield RolloutRouter(rs)
    rs.close()
    stack.close()


def test_a_prompt_the_engine_refuses_is_the_requests_error_and_quarantines_no_replica(router) -> None:
    with pytest.raises(TransferError, match=r"sampling 2 completions of prompt 0 \(3 tokens, up to 2 new\) "
                       r"under policy-v1 was refused by replica \d .*HTTP 400.*maximum context length is 4 tokens"):
        router.generate([[1, 2, 3]] * 2, "policy-v1", 2, 1.0, 0, [])
    rs = router.replicas
    assert [r.quarantines for r in rs.replicas] == [0, 0, 0] and len(rs.live()) == 3
    assert [r.outstanding for r in rs.replicas] == [0, 0, 0], "the refused work is given back"
    out = router.generate([[1]] * 2, "policy-v1", 2, 1.0, 0, [])  # a prompt that fits goes through
    assert [c.token_ids for c in out] == [[7], [7]]
