"""Episode capture at the ASGI layer: a chat completion that names an episode becomes a turn of it.

A request to `/v1/chat/completions` with the header `protocol.EPISODE_HEADER` (the openai client sends it
with `extra_headers=`) is rewritten before vLLM sees it: `return_token_ids` and `logprobs` are set (vLLM's
own fields: the response then carries `prompt_token_ids`, the rendered prompt, and per choice `token_ids`
and `logprobs.content`), and a turn after the first runs on the version the first ran on. The response
passes to the client unchanged (with those fields); its last body chunk is held until the turn is in the
store, so a client that fetches the episode after the reply finds it. A streamed turn (`stream=true`) is
read from its server-sent events: the prompt ids come on the first chunk, the sampled ids and log-probs
in deltas.

The engine enforces the pin: a later turn that asks for the episode's alias (the moving `<lora_name>`)
gets the pinned `<lora_name>-v<step>`; asking for any other model is refused (409). A pinned version the
trainer retired meanwhile is answered 404 like any retired version (the loop's straggler rule).
`n > 1` is refused: an episode is one trajectory.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from starlette.datastructures import Headers

from titan_lora.engines.episode_log import CapturedTurn, EpisodeLog, Pin
from titan_lora.engines.episode_store import EpisodeStore
from titan_lora.transfer import protocol
from titan_lora.transfer.episodes import check_episode_id

CHAT_PATH = "/v1/chat/completions"


class EpisodeRefused(Exception):
    """A turn the engine will not run as part of its episode (`code`: the HTTP status)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def episode_of(scope: dict) -> str | None:
    """The episode a request names in its header, or None; EpisodeRefused for a malformed id."""
    value = Headers(scope=scope).get(protocol.EPISODE_HEADER)
    if value is None:
        return None
    try:
        return check_episode_id(value)
    except ValueError as err:
        raise EpisodeRefused(400, f"{protocol.EPISODE_HEADER}: {err}") from None


def prepare_turn(path: str, body: dict, log: EpisodeLog | None) -> dict:
    """The body vLLM runs for a turn of the episode `log` (None: its first turn)."""
    header = protocol.EPISODE_HEADER
    if path != CHAT_PATH:
        raise EpisodeRefused(400, f"{header} is captured on {CHAT_PATH} only, not on {path}: drop the header")
    if body.get("n") not in (None, 1):
        raise EpisodeRefused(400, f"{header}: an episode is one trajectory, so n must be 1 "
                                  f"(got {body['n']}); run n episodes for a group")
    model = body.get("model")
    pin = log.pin if log is not None else None
    if pin is not None:
        if model not in (pin.model, pin.alias):
            asks = " or ".join(repr(m) for m in (pin.alias, pin.model) if m)
            raise EpisodeRefused(409, f"episode {log.episode_id!r} runs on {pin.model!r}, the version its "
                                      f"first turn got; this turn asked for {model!r}: ask for {asks}, or "
                                      "start a new episode")
        model = pin.model
    return {**body, "model": model, "return_token_ids": True, "logprobs": True}


def merged_stream(reply: bytes) -> dict:
    """A streamed chat completion's server-sent events as one response of the non-streamed shape."""
    events = [json.loads(line[len("data: "):]) for line in reply.decode().splitlines()
              if line.startswith("data: ") and line.strip() != "data: [DONE]"]
    if not events:
        raise ValueError("the stream carried no events")
    failed = next((e["error"] for e in events if "error" in e), None)
    if failed is not None:
        raise ValueError(f"the stream ended in an error: {failed}")
    ids: list[int] | None = None  # None: no chunk carried token ids (a reasoning parser hid them)
    content, finish = [], None
    for event in events:
        for choice in event.get("choices") or []:  # n == 1; the usage chunk has none
            if choice.get("token_ids") is not None:
                ids = ids or []
                ids.extend(choice["token_ids"])
            content += (choice.get("logprobs") or {}).get("content") or []
            finish = choice.get("finish_reason") or finish
    prompt = next((e["prompt_token_ids"] for e in events if e.get("prompt_token_ids") is not None), None)
    return {"model": events[0]["model"], "prompt_token_ids": prompt,
            "choices": [{"token_ids": ids, "logprobs": {"content": content}, "finish_reason": finish}]}


def turn_of(reply: bytes, streamed: bool = False) -> CapturedTurn:
    """The turn a chat-completion response (`streamed`: its event stream) carries; ValueError says what
    it lacks."""
    data = merged_stream(reply) if streamed else json.loads(reply)
    choice = data["choices"][0]
    prompt, sampled = data.get("prompt_token_ids"), choice.get("token_ids")
    if prompt is None or sampled is None:
        raise ValueError("the response carries no prompt_token_ids or token_ids (a reasoning parser hides "
                         "them when include_reasoning is false): not captured")
    content = (choice.get("logprobs") or {}).get("content")
    if content is None or len(content) != len(sampled):
        raise ValueError(f"the response has {len(sampled)} sampled ids but "
                         f"{'no' if content is None else len(content)} log-probs: not captured")
    return CapturedTurn(list(prompt), list(sampled), [float(c["logprob"]) for c in content], data["model"],
                        choice.get("finish_reason"))


def recording_send(send: Callable[[dict], Awaitable[None]], store: EpisodeStore, episode_id: str,
                   pin: Pin) -> Callable[[dict], Awaitable[None]]:
    """`send`, that adds a successful response's turn to the episode before its last chunk goes out; `pin`:
    the version the turn was resolved to (it pins the episode when this is its first turn)."""
    status, streamed, chunks = 0, False, []

    async def recorded(message: dict) -> None:
        nonlocal status, streamed
        if message["type"] == "http.response.start":
            status = message["status"]
            streamed = Headers(raw=message.get("headers", [])).get("content-type", "").startswith(
                "text/event-stream")
        elif message["type"] == "http.response.body" and status == 200:
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                _add(store, episode_id, b"".join(chunks), streamed, pin)
        await send(message)

    return recorded


def _add(store: EpisodeStore, episode_id: str, reply: bytes, streamed: bool, pin: Pin) -> None:
    try:
        turn = turn_of(reply, streamed)
    except (ValueError, KeyError, IndexError, TypeError) as err:
        store.note(episode_id, f"{type(err).__name__}: {err}")
        return
    store.add_turn(episode_id, turn, pin)

