"""Rollouts over the OpenAI API (`/v1/completions`), from any OpenAI-compatible engine that serves our
adapters under their versioned names; through the `openai` package.

generate: token-id prompts in; sampled token ids and the log-prob of each out (`logprobs=0` and vLLM's
`return_token_ids`). A run of identical prompts (a GRPO group) is one request with `n` samples: vLLM
seeds sample i of a request with `seed + i`, so prompt k of the call is sampled with `seed + k`, as on
titan_lora's own engine. Runs go out concurrently and the engine batches them.
chat: one `/v1/chat/completions` turn, its text and the served model name (the agentic example's).
score: vLLM's `prompt_logprobs` with `max_tokens=1`, one sequence per request, the requests concurrent
(titan_lora's vLLM engine computes prompt log-probs right in a batch with other requests:
`vllm_compat.score_prompt_rows_under_their_adapter`).

Every request ends within `timeout_s`; a request the client gave up on is aborted by vLLM when the
connection drops. Requests run on the client's threads while the caller waits, so that `interrupt` (the
engine was found wedged) ends the wait at once instead of after `timeout_s`; so do an agent's episodes
(`wait_for`, over `client`) and the requests of `episode_routes`.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from titan_lora.clients.base import Endpoint
from titan_lora.clients.http import ApiKey, JsonClient
from titan_lora.clients.rollout import REFUSED_STATUSES, Completion, RequestRefused, Samples, SampleSpec
from titan_lora.config import WeightSync
from titan_lora.transfer.errors import EngineHung, EngineUnreachable, TransferError

MAX_CONCURRENT = 64
"""Requests in flight at once: the async loop keeps (max_staleness + 1) x prompts_per_step groups out, with
the held-out eval and the parity probe beside them."""
T = TypeVar("T")
KEEPALIVE_EXPIRY_S = 2.0
"""How long an idle connection to the engine is kept for reuse: under every server's keep-alive (vLLM: 5 s)."""


def prompt_topk(position: dict[str, dict], k: int) -> list[tuple[int, float]]:
    """A prompt position's k likeliest (token id, log-prob), from vLLM's `prompt_logprobs` entry (keyed by id,
    ranked; the prompt token itself is there too, at its own rank)."""
    ranked = sorted((entry["rank"], int(token), entry["logprob"]) for token, entry in position.items())
    return [(token, logprob) for rank, token, logprob in ranked if rank <= k]


def sampled_topk(positions: list[dict[str, float]], k: int) -> list[list[tuple[int, float]]]:
    """Each sampled token's k likeliest (token id, log-prob), from vLLM's `top_logprobs` keyed "token_id:<id>"
    (the sampled token is added when it is not among them: it is then the least likely, and left out)."""
    return [sorted(((int(key.removeprefix("token_id:")), value) for key, value in position.items()),
                   key=lambda pair: -pair[1])[:k] for position in positions]


@dataclasses.dataclass(frozen=True)
class ChatReply:
    """One chat turn's text and the model name that served it (`<lora_name>-v<step>` for an adapter)."""

    model: str
    text: str


def prompt_runs(prompts: list[list[int]]) -> list[tuple[int, list[int], int]]:
    """(index of the first, prompt, count) for each run of identical consecutive prompts."""
    runs, start = [], 0
    for prompt, group in itertools.groupby(prompts):
        n = len(list(group))
        runs.append((start, prompt, n))
        start += n
    return runs


class OpenAIRolloutClient:
    """RolloutClient over `/v1/completions`; `adapter` is the model name (None: the base model)."""

    def __init__(self, base_url: str, api_key: str | ApiKey = "", timeout_s: float = 600.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"[weight_sync] rollout_timeout_s must be positive, got {timeout_s}")
        try:
            import httpx  # openai's own transport
            import openai
        except ImportError as err:
            raise ImportError("rollouts over the OpenAI API need the `openai` package (vLLM installs it): "
                              "pip install openai") from err

        self._openai, self._httpx = openai, httpx
        self._url = base_url.rstrip("/") + "/v1"
        self._key = api_key if isinstance(api_key, ApiKey) else ApiKey(api_key)
        self.timeout_s = timeout_s
        self._waits: set[Future] = set()  # one per caller waiting now: `interrupt` fails them
        self._lock = threading.Lock()
        self._fresh()
        self._base: str | None = None
        self._routes = JsonClient(self._url.removesuffix("/v1"), self._key, self.timeout_s)

    def _fresh(self) -> None:
        # No retries: a retried sample would be a second, different sample under the same seed slot. So an
        # idle connection must never be reused just as the server closes it: httpx keeps one 5 s, exactly
        # vLLM's keep-alive (VLLM_HTTP_TIMEOUT_KEEP_ALIVE), and the race surfaced as "Connection error."
        # in a parity probe; ours expire well before the server's.
        http = self._openai.DefaultHttpxClient(limits=self._httpx.Limits(
            max_connections=1000, max_keepalive_connections=100, keepalive_expiry=KEEPALIVE_EXPIRY_S))
        self._client = self._openai.OpenAI(base_url=self._url, api_key=self._key.value or "none",
                                           timeout=self.timeout_s, max_retries=0, http_client=http)
        self._pool = ThreadPoolExecutor(max_workers=MAX_CONCURRENT, thread_name_prefix="titan-rollout")

    @property
    def client(self) -> Any:
        """The `openai.OpenAI` client, carrying the key of the engine's current incarnation (an embedded
        engine gets a new one at each start)."""
        self._client.api_key = self._key.value or "none"
        return self._client

    def episode_routes(self) -> JsonClient:
        """The client of the engine's `/titan` routes (episode records), with this client's key and timeout;
        `interrupt` ends its requests too."""
        return self._routes

    def interrupt(self, reason: str) -> None:
        """Fail every call waiting now with EngineHung (`reason`: the engine was found wedged). Their
        requests are left to a fresh connection pool and threads, so later calls do not queue behind them."""
        with self._lock:
            waits, self._waits = self._waits, set()
            pool = self._pool
            self._fresh()
        for waiting in waits:
            waiting.set_exception(EngineHung(f"{self.client.base_url}: abandoned: {reason}"))
        pool.shutdown(wait=False, cancel_futures=True)
        self._routes.interrupt(reason)

    def wait_for(self, fn: Callable[[], T]) -> T:
        """`fn()` (an agent's episode, its turns over `client`), run on a thread of its own while the caller
        waits, so that `interrupt` ends the wait at once; the abandoned thread ends with its request."""
        done: Future = Future()

        def run() -> None:
            try:
                done.set_result(fn())
            except BaseException as err:  # noqa: BLE001 (the caller's to see)
                done.set_exception(err)

        # A daemon thread, not the pool: an episode holds it for many turns, and one hung on a wedged engine
        # must not hold the process at exit.
        threading.Thread(target=run, name="titan-episode-turns", daemon=True).start()
        return self._await([done])[0]

    def _await(self, futures: list[Future]) -> list[Any]:
        """The results of `futures` in order; the first error raised at once, as is `interrupt`'s."""
        interrupted: Future = Future()
        with self._lock:
            self._waits.add(interrupted)
        try:
            pending = set(futures)
            while pending:
                done, pending = wait(pending | {interrupted}, return_when=FIRST_COMPLETED)
                pending.discard(interrupted)
                for future in done:
                    if future.exception() is not None:
                        raise future.exception()
            return [f.result() for f in futures]
        finally:
            with self._lock:
                self._waits.discard(interrupted)

    def _submit(self, fn: Any, *args: Any, **kwargs: Any) -> Future:
        with self._lock:
            return self._pool.submit(fn, *args, **kwargs)

    def _model(self, adapter: str | None) -> str:
        if adapter is not None:
            return adapter
        if self._base is None:  # the served base: the card that is no adapter of another
            cards = self._await([self._submit(self._call, self.client.models.list)])[0].data
            self._base = next(c.id for c in cards if getattr(c, "parent", None) is None)
        return self._base

    def _call(self, fn: Any, **kwargs: Any) -> Any:
        """One API call, its failures as the errors the syncer recovers from."""
        try:
            return fn(**kwargs)
        except self._openai.AuthenticationError:
            raise TransferError(f"{self.client.base_url} refused the API key (HTTP 401): set [engine] api_key "
                                "to the key the engine was started with") from None
        except self._openai.OpenAIError as err:
            lost = engine_failure(err, str(self.client.base_url), f"within {self.timeout_s:g} s ([weight_sync] "
                                  "rollout_timeout_s); the engine aborts the request")
            if lost is None and isinstance(err, self._openai.APIStatusError):  # a 4xx
                refused = err.status_code in REFUSED_STATUSES  # the request was wrong, not the engine
                lost = (RequestRefused if refused else TransferError)(
                    f"{self.client.base_url} failed with HTTP {err.status_code}: {err.message}")
            if lost is None:
                raise
            raise lost from None

    def _complete(self, model: str, prompt: list[int], n: int, spec: SampleSpec) -> Samples:
        """One `/v1/completions` request on a pool thread: `n` completions of `prompt` (greedy: one, repeated:
        vLLM refuses n > 1 without sampling), stop strings kept at the end of each completion."""
        greedy = spec.temperature == 0
        extra: dict[str, Any] = {"return_token_ids": True, "top_k": spec.top_k, "include_stop_str_in_output": True,
                                 "stop_token_ids": list(spec.stop_token_ids)}
        if spec.stop == ():
            extra["ignore_eos"] = True
        if spec.prompt_logprobs or spec.prompt_topk:
            extra["prompt_logprobs"] = spec.prompt_topk  # the prompt token's own, and the k likeliest
        if spec.sample_topk:
            extra["return_tokens_as_token_ids"] = True  # top-k keyed "token_id:<id>", not by text
        reply = self._call(self.client.completions.create, model=model, prompt=prompt, n=1 if greedy else n,
                           seed=spec.seed, max_tokens=spec.max_tokens, temperature=spec.temperature,
                           top_p=spec.top_p, logprobs=spec.sample_topk, stop=list(spec.stop or []) or None,
                           extra_body=extra)
        if reply.model != model:
            raise TransferError(f"asked for model {model!r}, the engine answered with {reply.model!r}")
        if len(reply.choices) != (1 if greedy else n):
            raise TransferError(f"asked for {n} completions, the engine returned {len(reply.choices)}")
        choices = sorted(reply.choices, key=lambda c: c.index)
        completions = [Completion(list(c.token_ids), c.text, list(c.logprobs.token_logprobs),
                                  "length" if c.finish_reason == "length" else "stop",
                                  sampled_topk(c.logprobs.top_logprobs, spec.sample_topk) if spec.sample_topk else None)
                       for c in choices]
        scored, topk = None, None
        if spec.prompt_logprobs or spec.prompt_topk:
            per_token = choices[0].prompt_logprobs
            scored = [None] + [per_token[j][str(prompt[j])]["logprob"] for j in range(1, len(prompt))]
            if spec.prompt_topk:
                topk = [None] + [prompt_topk(per_token[j], spec.prompt_topk) for j in range(1, len(prompt))]
        return Samples(completions * n if greedy else completions, scored, topk)

    def generate(self, prompts: list[list[int]], adapter: str | None, max_tokens: int,
                 temperature: float, seed: int | None, stop_token_ids: list[int]) -> list[Completion]:
        """One completion per token-id prompt, sampled under model `adapter` (None: the base)."""
        model = self._model(adapter)
        runs = prompt_runs(prompts)  # a run of identical prompts (a group): one request with n samples
        futures = [self._submit(self._complete, model, prompt, n,
                                SampleSpec(max_tokens, temperature, seed=None if seed is None else seed + start,
                                           stop_token_ids=tuple(stop_token_ids)))
                   for start, prompt, n in runs]
        return [c for samples in self._await(futures) for c in samples.completions]

    def sample(self, prompt: list[int], adapter: str | None, n: int, spec: SampleSpec) -> Samples:
        """`n` completions of one token-id prompt under model `adapter` (None: the base), in one request."""
        return self._await([self._submit(self._complete, self._model(adapter), prompt, n, spec)])[0]

    def chat(self, model: str, messages: list[dict], max_tokens: int, temperature: float,
             seed: int | None = None) -> ChatReply:
        """One `/v1/chat/completions` turn under `model` (the engine applies the chat template)."""
        reply = self._await([self._submit(self._call, self.client.chat.completions.create, model=model,
                                          messages=messages, max_tokens=max_tokens, temperature=temperature,
                                          seed=seed)])[0]
        return ChatReply(reply.model, reply.choices[0].message.content or "")

    def score(self, sequences: list[list[int]], adapter: str | None) -> list[list[float]]:
        """log p(token t | tokens < t) for every token after the first of each sequence; the sequences
        go out concurrently, one request each, and the engine batches them."""
        model = self._model(adapter)

        def one(ids: list[int]) -> list[float]:
            reply = self._call(self.client.completions.create, model=model, prompt=ids, max_tokens=1,
                               temperature=0.0, extra_body={"prompt_logprobs": 0})
            if reply.model != model:
                raise TransferError(f"asked for model {model!r}, the engine answered with {reply.model!r}")
            per_token = reply.choices[0].prompt_logprobs
            return [per_token[j][str(ids[j])]["logprob"] for j in range(1, len(ids))]

        return self._await([self._submit(one, ids) for ids in sequences])


def openai_rollouts(endpoint: Endpoint, ws: WeightSync) -> OpenAIRolloutClient:
    """The rollout client of an OpenAI-compatible engine at `endpoint`."""
    return OpenAIRolloutClient(endpoint.url, endpoint.api_key, ws.rollout_timeout_s)


def engine_failure(err: BaseException, where: str, in_time: str = "in time") -> TransferError | None:
    """The error the loop recovers from when the `openai` client's `err` is the engine's failure, not the
    caller's: no answer (EngineHung), no connection (EngineUnreachable), an HTTP 5xx such as a dead engine
    core (TransferError); None for anything else. `where` starts the message, `in_time` says the limit."""
    import openai  # vLLM installs it; a caller that got an openai error has it

    if isinstance(err, openai.APITimeoutError):
        return EngineHung(f"{where}: no answer {in_time}")
    if isinstance(err, openai.APIConnectionError):
        return EngineUnreachable(f"{where}: {err}")
    if isinstance(err, openai.InternalServerError):  # HTTP >= 500
        return TransferError(f"{where} failed with HTTP {err.status_code}: {err.message}")
    return None
