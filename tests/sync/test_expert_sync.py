"""Adapters on a mixture-of-experts model's routed experts synced like any other tensors: a tiny random Qwen3-MoE
(4 experts, layer 0 routed, layer 1 dense) with LoRA on attention and every expert, on 2 gloo ranks (FSDP over
the experts, the adapters sharded), synced twice into the real receiver process: its SHA-256 of every tensor
equals the PEFT export's (the directory HF + peft loads with the trainer's log-probs, tests/models/
test_qwen3_moe.py), the fused expert tensors included. vLLM builds such an adapter per expert
(`transfer/moe_layout.per_expert_adapter`, as the engine side does it, checked against the export's rewrite
here) and serves it only on GPU; an engine that says it serves no expert LoRA is refused at start
(tests/sync/test_syncer_sends.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from dist_helpers import run_ranks
from model_helpers import build_from, job_config_from, lora_toml, randomize_adapters
from safetensors.torch import load_file
from syncer_helpers import CPU, engine_digest, shim_on_path, start_receiver, sync_cfg
from test_syncer import digests
from tiny_checkpoints import tiny_qwen3_moe

from titan_lora.clients.http import JsonClient
from titan_lora.clients.vllm import VLLMBucketEmitter
from titan_lora.sync.adapter_source import AdapterSource
from titan_lora.sync.base_stream import base_weights_source
from titan_lora.sync.syncer import WeightSyncer
from titan_lora.sync.versions import AdapterVersions
from titan_lora.transfer.transport import plain_buffer

def _toml(hf_dir: Path) -> str:
    """LoRA r4 on the tiny Qwen3-MoE's attention and every expert."""
    model = f'name = "qwen3_moe"\nhf_assets_path = "{hf_dir}"\nload_pretrained = true'
    return lora_toml(model, 4, 8).replace('target_modules = "all-linear"',
                                          'target_modules = ["q_proj", "v_proj", "o_proj", "experts"]')


FUSED = ("mlp.experts.base_layer.lora_A.weight", "mlp.experts.base_layer.lora_B.weight",
         "mlp.experts.lora_A.weight", "mlp.experts.lora_B.weight")


def _sync_experts(rank: int, world: int, hf_dir: str, tmp: str) -> None:
    shim_on_path()
    toml = _toml(Path(hf_dir))
    cfg = sync_cfg(keep_versions=1)
    engine = start_receiver(tmp) if rank == 0 else None
    built, lora = build_from(toml, "--lora.no_replicate_adapters"), job_config_from(toml).lora
    emitter = VLLMBucketEmitter(JsonClient(engine.url, engine.key, cfg.timeout_s), cfg.bucket_mb) if rank == 0 else None
    source = AdapterSource(built.model, built.peft_layout, lora, cfg.lora_name,
                           lend=emitter.lend_buffer if emitter else plain_buffer)
    assert source.adapts_experts
    syncer = WeightSyncer(source, base_weights_source(built.model, built.sd_adapter, tied_embeddings=False),
                          emitter, cfg, CPU, versions=AdapterVersions(cfg.lora_name, 1), engine=engine)
    try:
        syncer.check_engine()  # the receiver says nothing of expert LoRA: it holds bytes
        for version in (1, 2):
            randomize_adapters(built.model, seed=version, std=0.1)
            metrics = syncer.sync(version)
            out = Path(tmp) / f"export{version}"
            source.export(out)  # collective
            if rank == 0:
                exported = load_file(str(out / "adapter_model.safetensors"))
                fused = [n for n in exported if n.endswith(FUSED)]
                assert len(fused) == 4, f"layer 0's gate_up and down A and B: {fused}"
                held = engine_digest(syncer, f"{cfg.lora_name}-v{version}")
                assert held == digests(exported), f"version {version}: the engine's bytes are not the export's"
                assert metrics["sync/tensors"] == len(exported)
    finally:
        syncer.close()


def test_expert_adapters_reach_the_engine_byte_for_byte_as_exported(tmp_path: Path) -> None:
    hf_dir = tiny_qwen3_moe(tmp_path / "hf")
    run_ranks(2, _sync_experts, str(hf_dir), str(tmp_path))


def test_the_engine_side_per_expert_build_is_the_exports_rewrite(tmp_path: Path) -> None:
    """What vllm_ext builds from a synced expert adapter is what `export.vllm_moe` writes (which vLLM's own
    LoRA code loads with each expert's update, tests/models/test_qwen3_moe.py)."""
    import json

    from titan_lora.export.vllm_moe import to_vllm_moe
    from titan_lora.transfer.moe_layout import per_expert_adapter

    hf_dir = tiny_qwen3_moe(tmp_path / "hf")
    toml = _toml(hf_dir)
    built = build_from(toml)
    randomize_adapters(built.model, seed=3, std=0.1)
    source = AdapterSource(built.model, built.peft_layout, job_config_from(toml).lora, "a")
    source.export(tmp_path / "peft")
    payload = source.snapshot(1)
    tensors, config = per_expert_adapter(payload.tensors, payload.peft_config)
    written = to_vllm_moe(tmp_path / "peft", tmp_path / "vllm")
    on_disk_config = json.loads((written / "adapter_config.json").read_text())
    assert config["target_parameters"] is None and payload.peft_config["target_parameters"]
    assert config["target_modules"] == on_disk_config["target_modules"] == [
        "down_proj", "gate_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    on_disk = load_file(str(written / "adapter_model.safetensors"))
    assert sorted(tensors) == sorted(on_disk) and all(torch.equal(tensors[n], on_disk[n]) for n in on_disk)
    assert any(".mlp.experts.3.up_proj.lora_B" in n for n in tensors)
