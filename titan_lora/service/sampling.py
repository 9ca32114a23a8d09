"""Sampling: a client's adapter published into the engine by titan_lora's sync, and samples drawn from exactly
that version.

`save_weights_for_sampler` runs on the trainer (`Publisher.publish`): one sync of that client's slot alone,
as version n of its family (`<slot>-v<n>`, n counting every publish of the service), acknowledged by the
engine (and, with `[weight_sync] parity_every = 1`, checked against the trainer's log-probs) before its
`tinker://<model>/sampler_weights/<name>` path is answered. A sampling session names such a path (or the
base model); each `sample` holds its version while it runs, so the retirer never unloads it mid-request. The
engine keeps `[weight_sync] keep_versions` versions of each client, those last published or sampled (a sampling
client that keeps sampling keeps its version; no client says when it is gone); a path retired since is
answered with an error saying so.
"""

from __future__ import annotations

import logging
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from titan_lora.clients.rollout import RolloutClient, SampleSpec
from titan_lora.service.futures import FutureStore, Result
from titan_lora.service.ledger import RequestError
from titan_lora.sync.adapter_set import AdapterSetSource
from titan_lora.sync.syncer import WeightSyncer
from titan_lora.sync.versions import AdapterVersions
from titan_lora.service.wire import SampledTokens, write_sample

logger = logging.getLogger(__name__)

UNSERVED_SAMPLE_FIELDS = {"target_prompt_logprobs": None, "prompt_alt_tokens_k": 0, "record_stability_info": None}
"""`sample` request fields not served, at the value that asks for nothing: a request asking for one of them is
refused, naming it, rather than answered without it."""
MAX_SAMPLES = 128
"""Samples one `sample` call may ask for."""
MAX_TOPK = 20
"""The most top-k log-probs a position may ask for: vLLM's default `--max-logprobs`."""
DEFAULT_MAX_TOKENS = 256
"""Tokens sampled when a call sets no max_tokens."""


@dataclass(frozen=True)
class SamplerWeights:
    """One published version of a client's adapter: its owner, its family (the client's slot), its version."""

    key: str
    model_id: str
    slot: int
    version: int


@dataclass(frozen=True)
class SamplingSession:
    """What a sampling client samples from: a version of an adapter, or the base (`weights` None)."""

    key: str
    weights: SamplerWeights | None
    path: str | None


class Sampling:
    """Sampler paths, sampling sessions, and the samples drawn from the engine (off the trainer's thread)."""

    def __init__(self, families: list[AdapterVersions], rollouts: RolloutClient, futures: FutureStore,
                 base_model: str, vocab_size: int) -> None:
        self.families, self.rollouts, self.futures = families, rollouts, futures
        self.base_model, self.vocab_size = base_model, vocab_size
        self._lock = threading.Lock()
        self._paths: dict[str, SamplerWeights] = {}
        self._sessions: dict[str, SamplingSession] = {}
        self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="tinker-sample")

    def saved(self, path: str, weights: SamplerWeights) -> None:
        """Record a published version under its `tinker://` path."""
        with self._lock:
            self._paths[path] = weights

    def has(self, key: str, path: str) -> bool:
        """Whether `path` names sampler weights of `key` published since the service started."""
        with self._lock:
            weights = self._paths.get(path)
        return weights is not None and weights.key == key

    def open(self, key: str, path: str | None) -> str:
        """A sampling session of `key` on `path` (None: the base model); its id."""
        weights = None
        if path is not None:
            with self._lock:
                weights = self._paths.get(path)
            if weights is None or weights.key != key:
                raise RequestError(f"no sampler weights {path} for this API key: save_weights_for_sampler returns "
                                   "tinker://<model>/sampler_weights/<name>", 404)
        session = f"sampler-{uuid.uuid4().hex[:16]}"
        with self._lock:
            self._sessions[session] = SamplingSession(key, weights, path)
        return session

    def session(self, session_id: str, key: str) -> SamplingSession:
        """`key`'s sampling session `session_id`."""
        with self._lock:
            found = self._sessions.get(session_id)
        if found is None or found.key != key:
            raise RequestError(f"sampling session {session_id!r} is not one of this API key's", 404)
        return found

    def submit(self, key: str, body: dict) -> dict:
        """`/asample`: checked now, sampled on a pool thread; the future and one sequence id per sample."""
        session = self.session(body["sampling_session_id"], key)
        prompt = [t for chunk in body["prompt"]["chunks"] for t in chunk.get("tokens", [])]
        if not prompt or any(c.get("type", "encoded_text") != "encoded_text" for c in body["prompt"]["chunks"]):
            raise RequestError("the prompt must be one or more encoded_text chunks with at least one token")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        n = int(body.get("num_samples", 1))
        if not 1 <= n <= MAX_SAMPLES:
            raise RequestError(f"num_samples = {n}; one call samples 1 to {MAX_SAMPLES}")
        asked = [f for f, none in UNSERVED_SAMPLE_FIELDS.items() if body.get(f, none) not in (none, False)]
        if asked:
            raise RequestError(f"{', '.join(asked)} not served: titan_lora's sample returns the sampled tokens' "
                               "log-probs and, with prompt_logprobs, each prompt token's (optionally the last "
                               "prompt_logprobs_last_n), and top-k log-probs of either; see docs/service.md")
        last_n = body.get("prompt_logprobs_last_n")
        if last_n is not None and not (body.get("prompt_logprobs") and 1 <= int(last_n) <= len(prompt) - 1):
            raise RequestError(f"prompt_logprobs_last_n = {last_n}: it needs prompt_logprobs and a value from 1 to "
                               f"len(prompt) - 1 = {len(prompt) - 1}")
        topk = {f: int(body.get(f) or 0) for f in ("topk_prompt_logprobs", "topk_sample_logprobs")}
        for field, k in topk.items():
            if not 0 <= k <= MAX_TOPK:
                raise RequestError(f"{field} = {k}: ask for 0 to {MAX_TOPK} (the engine's --max-logprobs)")
        spec = replace(sample_spec(body.get("sampling_params") or {}, bool(body.get("prompt_logprobs"))),
                                   prompt_topk=topk["topk_prompt_logprobs"], sample_topk=topk["topk_sample_logprobs"])
        request_id = self.futures.new(key)
        self._pool.submit(self._sample, request_id, session, prompt, n, spec, last_n)
        return {"request_id": request_id, "sample_sequence_ids": [uuid.uuid4().hex for _ in range(n)]}

    def _sample(self, request_id: str, session: SamplingSession, prompt: list[int], n: int, spec: SampleSpec,
                last_n: int | None = None) -> None:
        try:
            if session.weights is None:
                samples = self.rollouts.sample(prompt, None, n, spec)
            else:
                with self.families[session.weights.slot].hold(session.weights.version) as lease:
                    samples = self.rollouts.sample(prompt, lease.name, n, spec)
            sequences = [SampledTokens(c.token_ids, c.logprobs, c.finish_reason == "stop", c.topk)
                         for c in samples.completions]
            scored = samples.prompt_logprobs if spec.prompt_logprobs else None
            topk = samples.prompt_topk
            if last_n is not None:  # the whole prompt was scored: keep the last n
                scored, topk = (None if v is None else [None] * (len(v) - last_n) + list(v[-last_n:])
                                for v in (scored, topk))
            result = Result(proto=write_sample(sequences, scored, topk, spec.prompt_topk, spec.sample_topk))
        except KeyError:
            result = Result(error=f"the sampler weights {session.path} are no longer served: the engine keeps the "
                                  "[weight_sync] keep_versions versions of each training client last saved or "
                                  "sampled; save again, or raise keep_versions", category="user")
        except Exception as err:  # noqa: BLE001 (the engine's fault fails this sample, not the service)
            logger.warning("a sample failed: %s", err)
            result = Result(error=f"{type(err).__name__}: {err}", category="server")
        self.futures.finish(request_id, result)


def sample_spec(params: dict, prompt_logprobs: bool) -> SampleSpec:
    """Tinker's SamplingParams as a SampleSpec (stop: strings, or token ids)."""
    stop = params.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    strings = tuple(s for s in stop or [] if isinstance(s, str))
    token_ids = tuple(int(s) for s in stop or [] if isinstance(s, int))
    return SampleSpec(max_tokens=int(params.get("max_tokens") or DEFAULT_MAX_TOKENS),
                      temperature=float(params.get("temperature", 1.0)), top_p=float(params.get("top_p", 1.0)),
                      top_k=int(params.get("top_k", -1)), seed=params.get("seed"),
                      stop=None if stop is None else strings, stop_token_ids=token_ids,
                      prompt_logprobs=prompt_logprobs)


class Publisher:
    """The trainer side of sampling: each save puts one client's slot into the engine as a new version."""

    def __init__(self, syncer: WeightSyncer, source: AdapterSetSource, sampling: Sampling | None) -> None:
        """`sampling`: rank 0's sampler paths (None on the other ranks, which only join the sync)."""
        self.syncer, self.source, self.sampling = syncer, source, sampling
        self.version = 0

    def start(self) -> None:
        """Collective: the engine gets the base (verified or sent) and every slot's empty adapter, version 0."""
        self.syncer.sync(0)

    def scale(self, slot: int, scale: float) -> None:
        """The engine scales `slot`'s adapter by `scale` (its config keeps the slot's padded rank)."""
        self.source.set_scale(slot, scale)

    def publish(self, key: str, model_id: str, slot: int, name: str) -> tuple[str, SamplerWeights | None, dict]:
        """Collective: `slot` into the engine as the next version, published once acknowledged; its path
        (rank 0; "" on the other ranks, which only take part in the gather)."""
        self.version += 1
        metrics = self.syncer.sync(self.version, only=[slot])
        if self.sampling is None:
            return "", None, metrics
        active = self.syncer.families[slot].active
        if active is None or active.version != self.version:
            raise RuntimeError(f"version {self.version} of {model_id} was not published (parity "
                               f"{metrics.get('sync/parity_max_abs', float('nan')):.3g} over the tolerance)")
        weights = SamplerWeights(key, model_id, slot, self.version)
        path = f"tinker://{model_id}/sampler_weights/{name or f'v{self.version}'}"
        self.sampling.saved(path, weights)
        return path, weights, metrics
