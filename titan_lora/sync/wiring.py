"""Assemble a WeightSyncer for a training run: engine, emitter, base source, parity probe.

train.py calls `syncer.sync(step)` itself after each optimizer step (contract C6)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import titan_lora.clients.disk  # noqa: F401  (registers "disk")
import titan_lora.clients.sglang  # noqa: F401  (registers "sglang")
import titan_lora.clients.vllm  # noqa: F401  (registers "vllm")
from titan_lora.clients.base import build_emitter
from titan_lora.clients.http import JsonClient
from titan_lora.clients.launch import EmbeddedEngine, engine_lora_rank
from titan_lora.clients.rollout import VLLMRolloutClient
from titan_lora.lora.layer import clean_fqn, is_adapter_param
from titan_lora.rl.tasks import chat_prompt, make_problems
from titan_lora.sync.parity import ParityProbe
from titan_lora.sync.syncer import BaseStream, WeightSyncer

if TYPE_CHECKING:
    from titan_lora.train import TrainingRun

logger = logging.getLogger(__name__)


def base_weights_source(model: nn.Module, sd_adapter, tied_embeddings: bool) -> BaseStream:  # noqa: ANN001
    """A collective generator of the base weights in HF naming: rank 0 gets one full tensor at a time,
    the other ranks keep nothing (they take part in each gather and drop its result).

    Every rank must run it to the end in the same order (each `full_tensor` is a collective). It runs
    once per engine incarnation, so a per-parameter gather is fine here; the per-step adapter path is
    the single-collective one.
    """

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        for name, param in model.named_parameters():
            if is_adapter_param(name):
                continue
            hf_name = _hf_name(sd_adapter, clean_fqn(name), param)  # same on every rank: no collective
            if hf_name is None or (tied_embeddings and hf_name == "lm_head.weight"):
                continue  # the engine ties lm_head to the embedding itself
            full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
            if rank0:
                # to_hf handles one tensor at a time: it renames and permutes wq/wk rows per key.
                (_, hf), = sd_adapter.to_hf({clean_fqn(name): full}).items()
                yield hf_name, hf
            del full  # other ranks: nothing kept

    return stream


def _hf_name(sd_adapter, name: str, param: torch.Tensor) -> str | None:  # noqa: ANN001
    """The HF name `name` maps to (None: the engine has no such weight), found on a meta tensor."""
    mapped = sd_adapter.to_hf({name: torch.empty(param.shape, device="meta")})
    return next(iter(mapped), None)


def probe_sequences(tokenizer, n: int = 4) -> list[list[int]]:  # noqa: ANN001
    """A fixed batch of chat-formatted arithmetic prompts with their answers, as token ids."""
    seqs = []
    for p in make_problems(n, seed=4242):
        text = chat_prompt(tokenizer, p.question) + str(p.answer) + tokenizer.eos_token
        seqs.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return seqs


def embedded_engine(run: TrainingRun, cfg) -> EmbeddedEngine:  # noqa: ANN001
    """The engine process titan_lora starts itself: the vLLM engine, or the receiver (timing only).

    Its API key is `[weight_sync] api_key`, or a random one; it reaches the engine by environment."""
    log = os.path.join(run.cfg.job.dump_folder, "engine.log")
    timeouts = {"start_timeout_s": cfg.engine_start_timeout_s, "health_timeout_s": cfg.health_timeout_s,
                "api_key": cfg.api_key}
    if cfg.engine == "receiver":
        device = ["--device", str(run.device)] if run.device.type == "cuda" else []
        return EmbeddedEngine("titan_lora.engines.receiver", cfg.engine_port, device, log, **timeouts)
    return EmbeddedEngine("titan_lora.engines.vllm_server", cfg.engine_port, [
        "--model", run.built.hf_dir, "--max-lora-rank", str(engine_lora_rank(run.cfg.lora.rank)),
        "--max-loras", str(cfg.keep_versions + 1), "--max-cpu-loras", str(cfg.keep_versions + 2),
        "--max-model-len", str(cfg.engine_max_model_len), "--kv-cache-gib", str(cfg.engine_kv_cache_gib),
    ], log, **timeouts)


def wire_syncer(run: TrainingRun) -> WeightSyncer:
    """Start or attach the engine (rank 0), build the syncer, validate limits."""
    from transformers import AutoTokenizer

    cfg = run.cfg.weight_sync
    rank0 = dist.get_rank() == 0
    emitter, engine, rollouts = None, None, None
    if rank0:
        if not cfg.engine_url:
            engine = embedded_engine(run, cfg)
            engine.start()
            cfg = dataclasses.replace(cfg, engine_url=engine.url, api_key=engine.api_key)
        emitter = build_emitter(cfg)
        if cfg.emitter != "sglang" and (cfg.engine == "vllm" or engine is None):
            rollouts = VLLMRolloutClient(JsonClient(cfg.engine_url, cfg.api_key, cfg.timeout_s),
                                         cfg.rollout_timeout_s)
    tokenizer = AutoTokenizer.from_pretrained(run.built.hf_dir)
    tied = json.loads((Path(run.built.hf_dir) / "config.json").read_text()).get("tie_word_embeddings", False)
    probe = None
    if cfg.parity_every:
        probe = ParityProbe(run.model, probe_sequences(tokenizer), run.device,
                            rollouts.score if rollouts else None, cfg.parity_tolerance)
    syncer = WeightSyncer(
        run.adapter, base_weights_source(run.model, run.built.sd_adapter, tied), emitter, cfg, run.device,
        engine=engine, rollouts=rollouts, probe=probe,
    )
    syncer.check_engine()
    return syncer
