"""The real trainer side (LoRA, AdapterSource, WeightSyncer) into the SGLang conformance server: SmolLM2's
syncs, and GRPO sampling on a tiny random Llama with SmolLM2's tokenizer (the conformance server runs the
model in Python: SmolLM2's base pushed into it and sampled there was a minute of CI)."""

from __future__ import annotations

import pytest
import torch
from model_helpers import SMOLLM2_LORA, build_from, job_config_from, randomize_adapters
from sglang_conformance import ConformanceServer
from tiny_checkpoints import SMOLLM2_VOCAB, hf_toml, tiny_llama
from transformers import AutoTokenizer, LlamaConfig

from titan_lora.clients.base import Endpoint
from titan_lora.clients.kinds import engine_kind
from titan_lora.config import Engine, WeightSync
from titan_lora.rl.rollout import sample_groups
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


@pytest.mark.slow
def test_grpo_samples_from_sglang_carry_the_trainers_logprobs(smollm2_dir, tmp_path):
    """sample_groups over the sglang kind's rollout client: the engine's log-prob of every sampled token is
    the trainer's own (torchtitan + LoRA), and the reward reads SGLang's detokenized text."""
    hf_dir = tiny_llama(tmp_path / "tiny_llama", vocab=SMOLLM2_VOCAB, tokenizer_from=smollm2_dir)
    toml = hf_toml("llama3", hf_dir)
    built = build_from(toml)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    task, problems = ArithTask(), make_problems(2, seed=5)
    prompts = [tokenizer(task_prompt(tokenizer, task, p.question), add_special_tokens=False)["input_ids"]
               for p in problems]
    server_cfg = {"max_lora_rank": 8, "lora_target_modules": ALL_LINEAR, "max_loaded_loras": 3,
                  "max_loras_per_batch": 4, "enable_deterministic_inference": True,
                  "detokenize": lambda ids: tokenizer.decode(ids, skip_special_tokens=True)}
    with ConformanceServer(LlamaConfig.from_pretrained(hf_dir), **server_cfg) as srv:
        cfg = WeightSync(enabled=True, keep_versions=2, timeout_s=120, retries=1, parity_every=0)
        kind, endpoint = engine_kind("sglang"), Endpoint(srv.url)
        source = AdapterSource(built.model, built.peft_layout, job_config_from(toml).lora)
        syncer = WeightSyncer(source, base_weights_source(built.model, built.sd_adapter, tied_embeddings=built.tied),
                              kind.emitter(cfg, Engine(kind="sglang", url=srv.url), endpoint), cfg,
                              torch.device("cpu"), versions=AdapterVersions("policy", 2))
        syncer.check_engine()
        try:
            randomize_adapters(built.model, seed=1)
            syncer.sync(1)
            rollouts = kind.rollouts(endpoint, cfg)
            samples = sample_groups(rollouts, syncer.versions, problems, prompts, group_size=2, max_tokens=8,
                                    temperature=1.0, seed=0, stop_token_ids=[tokenizer.eos_token_id],
                                    reward=task.reward)
            seqs = [s.prompt_ids + s.completion_ids for s in samples]
            ours = trainer_logprobs(built.model, seqs, torch.device("cpu"))
            diff = max(max(abs(a - b) for a, b in zip(s.engine_logprobs, o[len(s.prompt_ids) - 1:]))
                       for s, o in zip(samples, ours))
            print(f"max |engine - trainer| sampled-token log-prob = {diff:.2e}")
            assert diff <= 1e-3 and {s.version for s in samples} == {1}
            assert all(s.text == tokenizer.decode(s.completion_ids, skip_special_tokens=True) for s in samples)
            assert all(s.reward == task.reward(s.text, problems[i // 2]) for i, s in enumerate(samples))
            scored = rollouts.score(seqs, syncer.versions.active.name)  # what the parity probe calls
            assert max(abs(a - b) for g, o in zip(scored, ours) for a, b in zip(g, o)) <= 1e-3
        finally:
            syncer.close()
