"""A WeightSyncer on 2 gloo ranks against the real receiver process (no vLLM, starts in ~2 s)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from model_helpers import DEBUG_LORA, build_from, full_adapter, full_copy, job_config_from, randomize_adapters

from titan_lora.clients.http import ApiKey, JsonClient
from titan_lora.compose import EngineSide
from titan_lora.clients.kinds import LaunchPlan
from titan_lora.clients.launch import EmbeddedEngine
from titan_lora.clients.vllm import VLLMBucketEmitter
from titan_lora.config import WeightSync
from titan_lora.export.peft import to_peft_names
from titan_lora.lora.layer import adapter_params, clean_fqn, is_adapter_param
from titan_lora.sync.adapter_source import AdapterSource
from titan_lora.sync.base_stream import base_weights_source
from titan_lora.sync.syncer import WeightSyncer
from titan_lora.sync.versions import AdapterVersions
from titan_lora.transfer.transport import plain_buffer

SHIM_DIR = str(Path(__file__).parent.parent / "engines")
CPU = torch.device("cpu")


def shim_on_path() -> None:
    """Let engine children import the receiver shim (tests/engines/receiver_shim.py)."""
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [SHIM_DIR, os.environ.get("PYTHONPATH")]))


def sync_cfg(**overrides) -> WeightSync:
    """[weight_sync] for the syncer tests: small buckets, one retry, short timeouts."""
    return WeightSync(**{"enabled": True, "bucket_mb": 1, "retries": 1, "timeout_s": 10.0, "retire_timeout_s": 5.0,
                         "parity_every": 0, "rollout_timeout_s": 30.0, "health_timeout_s": 2.0,
                         "engine_start_timeout_s": 60.0, "engine_restarts": 2, **overrides})


def start_receiver(tmp: str, max_loras: int = 8) -> EmbeddedEngine:
    """The receiver process, embedded: our nonce, a random key by environment."""
    engine = EmbeddedEngine(LaunchPlan("receiver_shim", ["--max-loras", str(max_loras)]), 0,
                            f"{tmp}/engine.log",
                            start_timeout_s=60, health_timeout_s=2.0)
    engine.start()
    return engine


def build_syncer(rank: int, cfg, engine: EmbeddedEngine | None, url: str = "", key: str | ApiKey = "",
                 probe=None, seed: int = 1):
    """(built model, syncer): the debug model with seeded adapters; rank 0 holds the emitter."""
    built = build_from(DEBUG_LORA)
    randomize_adapters(built.model, seed=seed)
    emitter = None
    if rank == 0:
        url, key = (engine.url, engine.key) if engine is not None else (url, key)  # the key of each start
        emitter = VLLMBucketEmitter(JsonClient(url, key, cfg.timeout_s), cfg.bucket_mb)
    source = AdapterSource(built.model, built.peft_layout, job_config_from(DEBUG_LORA).lora, cfg.lora_name,
                           lend=emitter.lend_buffer if emitter else plain_buffer)
    base = base_weights_source(built.model, built.sd_adapter, tied_embeddings=True)
    versions = AdapterVersions(cfg.lora_name, cfg.keep_versions)
    side = EngineSide(engine, emitter)  # the watchdog as the job composes it (rank 0 only)
    return built, WeightSyncer(source, base, emitter, cfg, CPU, versions=versions, engine=engine, probe=probe,
                               watchdog=side.watchdog(cfg))


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: every param as one full tensor, by its torchtitan name."""
    return {clean_fqn(n): full_copy(p) for n, p in model.named_parameters()}


def expected_adapter(built) -> dict[str, torch.Tensor]:
    """Collective: the adapter in PEFT naming, from the model's params (the oracle: torchtitan names
    renamed and permuted by the export path, not by the gatherer)."""
    return to_peft_names(full_adapter(adapter_params(built.model)), built.peft_layout)


def expected_base(built) -> dict[str, torch.Tensor]:
    """Collective: the base in HF naming, converted as a whole by torchtitan's adapter; lm_head tied."""
    state = {n: t for n, t in full_state(built.model).items() if not is_adapter_param(n)}
    hf = built.sd_adapter.to_hf(state)
    hf.pop("lm_head.weight", None)
    return hf


def engine_digest(syncer: WeightSyncer, name: str) -> dict[str, str]:
    """Rank 0: SHA-256 per tensor of what the receiver holds (`name`: an adapter, or "base")."""
    return syncer.emitter.client.post("/titan/digest", {"name": name})


def engine_adapters(syncer: WeightSyncer) -> list[str]:
    """Rank 0: adapter names the receiver holds."""
    return syncer.emitter.client.post("/titan/info")["adapters"]


def kill(engine: EmbeddedEngine) -> None:
    """SIGKILL the engine process and reap it."""
    os.kill(engine.proc.pid, signal.SIGKILL)
    engine.proc.wait(10)


def barrier() -> None:
    """All ranks meet (gloo)."""
    if dist.is_initialized():
        dist.barrier()
