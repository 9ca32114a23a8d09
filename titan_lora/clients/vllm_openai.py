"""The `vllm` engine kind (also `vllm-openai`): vLLM's own OpenAI server with titan_lora's transfer
routes inside (`titan_lora.engines.vllm_openai`); adapters go in buckets (`VLLMBucketEmitter`), rollouts
over `/v1/completions`. The `vllm-disk` baseline (`clients/disk.py`) runs on the same engine."""

from __future__ import annotations

import dataclasses
import os

from titan_lora.clients.kinds import EngineKind, LaunchPlan, LaunchRequest
from titan_lora.clients.launch import engine_lora_rank
from titan_lora.clients.openai_rollout import openai_rollouts
from titan_lora.clients.vllm import build_vllm_emitter
from titan_lora.transfer import protocol, vllm_release


def vllm_openai_launch(req: LaunchRequest) -> LaunchPlan:
    """`vllm serve` flags for the job: fp32 on the trainer's model, adapter slots for every live version
    plus one being installed, bound to localhost; no base digests where nobody asks for them."""
    skip = [] if req.base_digests else [protocol.SKIP_BASE_DIGESTS_FLAG]
    env = {"OMP_NUM_THREADS": str(cpu_threads(req))} if req.device.type == "cpu" else {}
    return LaunchPlan("titan_lora.engines.vllm_openai", [
        req.hf_dir, "--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager", "--seed", "0",
        "--max-lora-rank", str(engine_lora_rank(req.lora_rank)),
        "--max-loras", str(req.adapter_slots), "--max-cpu-loras", str(req.adapter_slots + 1),
        "--max-model-len", str(req.engine.max_model_len), "--max-num-seqs", "64",
        "--max-num-batched-tokens", str(max(4096, req.engine.max_model_len)),
        "--kv-cache-memory-bytes", str(req.engine.kv_cache_gib * 2**30), "--disable-uvicorn-access-log", *skip,
    ], env, standby=keeps_standby(req))


def keeps_standby(req: LaunchRequest) -> bool:
    """`[engine] standby`: on, off, or (auto) on for a GPU engine only: on CPU the standby's import of vLLM
    would compete with the job for the same cores."""
    return req.engine.standby == "on" or (req.engine.standby == "auto" and req.device.type != "cpu")


def cpu_threads(req: LaunchRequest) -> int:
    """A CPU engine's torch threads: `[engine] cpu_threads`, or this process's cores shared among the replicas.
    Under torchrun the engine would inherit a rank's OMP_NUM_THREADS=1: its forward passes (the rollouts of a
    sync-loop step, while the trainer waits) would use one core of the machine."""
    return req.engine.cpu_threads or max(1, len(os.sched_getaffinity(0)) // req.engine.replicas)


def check_installed_vllm() -> None:
    """Refuse to start the engine on this host's vLLM when titan_lora was not tested with it (the engine
    would refuse too, after the trainer built its model)."""
    refusal = vllm_release.refusal(vllm_release.installed_version())
    if refusal is not None:
        raise ValueError(refusal)


VLLM_OPENAI = EngineKind("vllm-openai", build_vllm_emitter, openai_rollouts, vllm_openai_launch,
                         shm_buckets=True, max_lora_rank=engine_lora_rank, check_host=check_installed_vllm)
VLLM = dataclasses.replace(VLLM_OPENAI, name="vllm")
"""The default engine kind."""
