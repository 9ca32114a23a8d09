"""The real trainer side (SmolLM2 + LoRA, AdapterSource, WeightSyncer) into the SGLang conformance server."""

from __future__ import annotations

import pytest
import torch
from model_helpers import SMOLLM2_LORA, build_from, job_config_from, randomize_adapters
from sglang_conformance import ConformanceServer
from transformers import AutoTokenizer, LlamaConfig

from titan_lora.clients.base import Endpoint
from titan_lora.clients.kinds import engine_kind
from titan_lora.config import Engine, WeightSync
from titan_lora.rl.task import task_prompt
from titan_lora.rl.tasks import ArithTask, make_problems
from titan_lora.sync.adapter_source import AdapterSource
from titan_lora.sync.base_stream import base_weights_source
from titan_lora.sync.parity import trainer_logprobs
from titan_lora.sync.syncer import WeightSyncer
from titan_lora.sync.versions import AdapterVersions

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.slow
def test_smollm2_syncs_serve_the_trainers_logprobs(smollm2_dir):
    built = build_from(SMOLLM2_LORA)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tokenizer(task_prompt(tokenizer, ArithTask(), make_problems(1, seed=3)[0].question),
                    add_special_tokens=False)["input_ids"]
    server_cfg = {"max_lora_rank": 8, "lora_target_modules": ALL_LINEAR, "max_loaded_loras": 3,
                  "max_loras_per_batch": 4}
    with ConformanceServer(LlamaConfig.from_pretrained(smollm2_dir), **server_cfg) as srv:
        cfg = WeightSync(enabled=True, keep_versions=2, timeout_s=120, retries=1, parity_every=0)
        emitter = engine_kind("sglang").emitter(cfg, Engine(kind="sglang", url=srv.url), Endpoint(srv.url))
        source = AdapterSource(built.model, built.peft_layout, job_config_from(SMOLLM2_LORA).lora)
        syncer = WeightSyncer(source, base_weights_source(built.model, built.sd_adapter, tied_embeddings=True),
                              emitter, cfg, torch.device("cpu"), versions=AdapterVersions("policy", 2))
        syncer.check_engine()
        served_by_version = []
        try:
            for step in (1, 2):
                randomize_adapters(built.model, seed=step)  # an optimizer step, in effect
                syncer.sync(step)
                active = syncer.versions.active
                assert active.name == f"policy-v{step}" and active.name in srv.engine.registry
                served = syncer.emitter.client.generate(ids, active.name, {"max_new_tokens": 1, "temperature": 0},
                                                        logprob_start_len=0)
                ours = torch.tensor(trainer_logprobs(built.model, [ids], torch.device("cpu"))[0])
                diff = (torch.tensor(served.input_logprobs[1:]) - ours).abs().max().item()
                print(f"v{step}: max |engine - trainer| log-prob = {diff:.2e}")
                assert diff <= 1e-3
                served_by_version.append(torch.tensor(served.input_logprobs[1:]))
            moved = (served_by_version[1] - served_by_version[0]).abs().max().item()
            assert moved > 0.01, "v2 must serve different log-probs from v1, or parity proves nothing"
            assert syncer.counters["base_sends"] == 1, "the base goes once per engine incarnation"
        finally:
            syncer.close()
