"""Episode capture at the ASGI layer without an engine: the header, the body a turn runs with (token ids and
log-probs asked for, the pinned version), reading vLLM's response, and recording before the last chunk."""

from __future__ import annotations

import asyncio
import json

import pytest

from titan_lora.engines.episode_capture import (
    CHAT_PATH, EpisodeRefused, episode_of, merged_stream, prepare_turn, recording_send, turn_of)
from titan_lora.engines.episode_log import EpisodeLog, Pin
from titan_lora.engines.episode_store import EpisodeStore
from titan_lora.transfer import protocol

V3 = Pin("policy-v3", "policy", 3)


def scope_with(header: str | None) -> dict:
    headers = [] if header is None else [(protocol.EPISODE_HEADER.lower().encode(), header.encode())]
    return {"type": "http", "headers": headers}


def pinned_log() -> EpisodeLog:
    log = EpisodeLog("e")
    log.pin = V3
    return log


def vllm_reply(model: str = "policy-v3", logprobs: int | None = None) -> dict:
    sampled = [7, 8, 2]
    count = len(sampled) if logprobs is None else logprobs
    content = [{"token": "x", "logprob": -0.25 * (i + 1)} for i in range(count)]
    return {"model": model, "prompt_token_ids": [1, 2, 3],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                         "finish_reason": "stop", "token_ids": sampled, "logprobs": {"content": content}}]}


def test_the_header_names_the_episode() -> None:
    assert episode_of(scope_with(None)) is None
    assert episode_of(scope_with("ep-1:a")) == "ep-1:a"
    with pytest.raises(EpisodeRefused, match="must be 1 to 128 of letters") as err:
        episode_of(scope_with("a b"))
    assert err.value.code == 400


def test_a_turn_asks_vllm_for_token_ids_and_log_probs() -> None:
    asked = {"model": "policy", "messages": [], "logprobs": False, "top_logprobs": 2}
    body = prepare_turn(CHAT_PATH, asked, None)
    assert body == {"model": "policy", "messages": [], "logprobs": True, "top_logprobs": 2,
                    "return_token_ids": True}


@pytest.mark.parametrize("asked", ["policy", "policy-v3"])
def test_a_later_turn_runs_on_the_pinned_version(asked: str) -> None:
    assert prepare_turn(CHAT_PATH, {"model": asked}, pinned_log())["model"] == "policy-v3"


def test_a_later_turn_that_asks_for_another_model_is_refused() -> None:
    why = "runs on 'policy-v3'.*asked for 'policy-v4': ask for 'policy' or 'policy-v3'"
    with pytest.raises(EpisodeRefused, match=why) as err:
        prepare_turn(CHAT_PATH, {"model": "policy-v4"}, pinned_log())
    assert err.value.code == 409


@pytest.mark.parametrize(("path", "body", "why"), [
    ("/v1/completions", {"model": "m"}, "captured on /v1/chat/completions only"),
    (CHAT_PATH, {"model": "m", "n": 4}, "n must be 1 \\(got 4\\)"),
])
def test_turns_that_cannot_be_captured_are_refused(path: str, body: dict, why: str) -> None:
    with pytest.raises(EpisodeRefused, match=why):
        prepare_turn(path, body, None)


def test_the_turn_a_response_carries() -> None:
    turn = turn_of(json.dumps(vllm_reply()).encode())
    assert (turn.prompt_ids, turn.sampled_ids, turn.logprobs) == ([1, 2, 3], [7, 8, 2], [-0.25, -0.5, -0.75])
    assert (turn.model, turn.finish_reason) == ("policy-v3", "stop")
    with pytest.raises(ValueError, match="3 sampled ids but 2 log-probs"):
        turn_of(json.dumps(vllm_reply(logprobs=2)).encode())
    hidden = vllm_reply()
    hidden["choices"][0]["token_ids"] = None
    with pytest.raises(ValueError, match="no prompt_token_ids or token_ids"):
        turn_of(json.dumps(hidden).encode())


def sse(events: list[dict]) -> bytes:
    """Events as vLLM streams them."""
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def streamed_reply() -> bytes:
    """`vllm_reply()` as vLLM streams it: the prompt ids on the first chunk, ids and log-probs in deltas,
    a usage chunk with no choices."""
    def delta(ids: list[int], lps: list[float], finish: str | None = None) -> dict:
        return {"index": 0, "delta": {"content": "h"}, "token_ids": ids, "finish_reason": finish,
                "logprobs": {"content": [{"token": "x", "logprob": lp} for lp in lps]}}
    return sse([{"model": "policy-v3", "prompt_token_ids": [1, 2, 3], "choices": [delta([], [])]},
                {"model": "policy-v3", "choices": [delta([7], [-0.25])]},
                {"model": "policy-v3", "choices": [delta([8, 2], [-0.5, -0.75], "stop")]},
                {"model": "policy-v3", "choices": [], "usage": {"completion_tokens": 3}}])


def test_a_streamed_turn_is_read_from_its_events() -> None:
    assert turn_of(streamed_reply(), streamed=True) == turn_of(json.dumps(vllm_reply()).encode())
    with pytest.raises(ValueError, match="the stream ended in an error: .*engine died"):
        merged_stream(sse([{"model": "m", "choices": []}, {"error": {"message": "engine died"}}]))
    with pytest.raises(ValueError, match="no events"):
        merged_stream(b"data: [DONE]\n\n")


def run_send(status: int, chunks: list[bytes], store: EpisodeStore,
             content_type: bytes = b"application/json") -> list[tuple[str, int]]:
    """Send a response through `recording_send`; for each message sent on, its type and the turns the
    episode had when it went out."""
    seen: list[tuple[str, int]] = []

    async def send(message: dict) -> None:
        log = store.get("e")
        seen.append((message["type"], len(log.record().turns) if log else 0))

    async def respond() -> None:
        wrapped = recording_send(send, store, "e", V3)
        await wrapped({"type": "http.response.start", "status": status,
                       "headers": [(b"content-type", content_type)]})
        for i, chunk in enumerate(chunks):
            await wrapped({"type": "http.response.body", "body": chunk, "more_body": i < len(chunks) - 1})

    asyncio.run(respond())
    return seen


def test_the_turn_is_recorded_before_the_last_chunk_reaches_the_client() -> None:
    store = EpisodeStore()
    raw = json.dumps(vllm_reply()).encode()
    seen = run_send(200, [raw[:10], raw[10:]], store)
    assert seen == [("http.response.start", 0), ("http.response.body", 0), ("http.response.body", 1)]
    assert store.fetch("e").model == "policy-v3" and store.fetch("e").sampled_ids(0) == [7, 8, 2]


def test_a_streamed_response_is_recorded_from_its_events() -> None:
    store = EpisodeStore()
    raw = streamed_reply()
    run_send(200, [raw[:40], raw[40:90], raw[90:]], store, b"text/event-stream; charset=utf-8")
    assert store.fetch("e").sampled_logprobs(0) == [-0.25, -0.5, -0.75]


def test_an_error_response_is_not_a_turn_and_an_unreadable_one_is_noted() -> None:
    store = EpisodeStore()
    run_send(400, [b'{"error": "too long"}'], store)
    assert store.get("e") is None
    run_send(200, [b'{"choices": []}'], store)
    assert store.fetch("e").notes == ("response 1: IndexError: list index out of range",)
