"""The Qwen3-MoE family: a tiny random HF Qwen3-MoE (4 experts of 32, top 2, renormalised; layer 1 dense) made
at test time, adapters on attention and on every expert.

- its config.json read as a shape (experts, top-k, dense layers);
- the base loaded through the sliced loader == HF's logits exactly; our log-probs with the adapter == HF + peft
  0.21 loading our export (<= 1e-4 fp32), on 2 FSDP ranks (the experts sharded 2 a rank);
- the export rewritten per expert is loaded by vLLM 0.32's own LoRA code (its rank check, its unexpected-module
  check, its MoE packing): each expert's gate/up/down update there == the trainer's B_e A_e * scale;
- one SFT step on 1 rank == on 2 FSDP ranks with the expert adapters sharded too;
- the router and the dense layers' MLP refused as targets, `experts` refused on a dense family, a sync of
  expert adapters refused (attention adapters sync: tests/engines/test_vllm_qwen3_moe.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dist_helpers import run_ranks
from model_helpers import (ONE_STEP_SECTIONS, build_from, full_copy, job_config_from, lora_toml,
                           randomize_adapters)
from tiny_checkpoints import SMOLLM2_VOCAB, hf_model, tiny_qwen3_moe

from titan_lora.export.vllm_moe import to_vllm_moe
from titan_lora.lora.layer import LoRAExperts, adapter_params, lora_modules
from titan_lora.lora.targets import resolve_target_names
from titan_lora.models.family import model_family
from titan_lora.models.qwen3_moe import shape_from_hf
from titan_lora.sync.adapter_source import AdapterSource

REPO = Path(__file__).resolve().parents[2]
TOKENS = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
TARGETS = '["q_proj", "v_proj", "o_proj", "experts"]'
EXPERTS, RANK, ALPHA = 4, 4, 8


def _toml(hf_dir: Path, targets: str = TARGETS) -> str:
    model = f'name = "qwen3_moe"\nhf_assets_path = "{hf_dir}"\nload_pretrained = true'
    return lora_toml(model, RANK, ALPHA).replace('target_modules = "all-linear"', f"target_modules = {targets}")


def test_config_json_gives_experts_top_k_and_dense_layers() -> None:
    base = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "intermediate_size": 96, "vocab_size": 256, "moe_intermediate_size": 32,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    shape = shape_from_hf({**base, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
                           "mlp_only_layers": [0], "decoder_sparse_step": 2})
    assert (shape.moe.num_experts, shape.moe.top_k, shape.moe.hidden_dim) == (8, 2, 32)
    assert shape.moe.norm_topk_prob and shape.moe.dense_layers == (0, 2)  # listed; (i + 1) % 2 != 0
    assert [shape.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    # transformers 5 writes num_local_experts; HF's default norm_topk_prob is False
    shape = shape_from_hf({**base, "num_local_experts": 4, "num_experts_per_tok": 2})
    assert shape.moe.num_experts == 4 and not shape.moe.norm_topk_prob and shape.moe.dense_layers == ()
    with pytest.raises(ValueError, match="no num_experts"):
        shape_from_hf(base)


def test_the_router_and_dense_mlps_of_an_moe_are_refused_and_experts_on_a_dense_family() -> None:
    names = model_family("qwen3_moe").leaf_names
    linears = ["layers.0.attention.qkv_linear.wq", "layers.0.moe.router.gate", "layers.1.feed_forward.w1"]
    assert resolve_target_names(linears, "all-linear", names) == ["layers.0.attention.qkv_linear.wq"]
    assert resolve_target_names(linears, ["q_proj", "experts"], names) == ["layers.0.attention.qkv_linear.wq"]
    with pytest.raises(ValueError, match=r"\['gate'\] name the MoE router"):
        resolve_target_names(linears, ["q_proj", "gate"], names)
    with pytest.raises(ValueError, match=r"\['gate_proj'\] name the MLP of this mixture-of-experts"):
        resolve_target_names(linears, ["gate_proj"], names)
    dense = lora_toml('name = "qwen3"\nflavor = "debug"\nload_pretrained = false').replace(
        'target_modules = "all-linear"', 'target_modules = ["q_proj", "experts"]')
    with pytest.raises(ValueError, match="no routed experts"):
        build_from(dense)


def test_a_sync_of_expert_adapters_into_an_engine_that_cannot_serve_them_or_tp_of_an_moe_is_refused_before_the_build(
        tmp_path, monkeypatch) -> None:
    hf_dir = tiny_qwen3_moe(tmp_path / "hf")
    toml = _toml(hf_dir)
    for kind, url, why in (("vllm", "", "the vLLM engine titan_lora starts here runs on CPU"),
                           ("sglang", "http://h:1", "SGLang loads no"),
                           ("vllm-disk", "", "the disk baseline writes PEFT's fused")):
        with pytest.raises(ValueError, match=rf"\[weight_sync\] enabled with adapters on the experts and "
                                             rf"\[engine\] kind = '{kind}': {why}.*drop \"experts\""):
            job_config_from(toml, "--weight_sync.enabled", f"--engine.kind={kind}", f"--engine.url={url}")
    job_config_from(_toml(hf_dir, '["q_proj", "o_proj"]'), "--weight_sync.enabled")  # attention only: synced
    job_config_from(toml, "--weight_sync.enabled", "--engine.kind=receiver")  # bytes: tests/sync/test_expert_sync.py
    job_config_from(toml, "--weight_sync.enabled", "--engine.url=http://gpu-host:8000")  # it says at start
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it for 2 ranks
    with pytest.raises(ValueError, match="TP-sharded experts is not built"):
        job_config_from(toml, "--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1")


def _export_and_score(rank: int, world: int, toml: str, out: str) -> None:
    built = build_from(toml)
    experts = [m for _, m in lora_modules(built.model) if isinstance(m, LoRAExperts)]
    assert len(experts) == 1, "layer 0's experts adapted, layer 1 dense"
    if world > 1:
        assert experts[0].w1_EFD.to_local().shape[0] == EXPERTS // world, "experts sharded by FSDP"
    randomize_adapters(built.model, std=0.1)
    AdapterSource(built.model, built.peft_layout, job_config_from(toml).lora).export(out)  # collective
    with torch.no_grad():
        scores = built.model(TOKENS).log_softmax(-1)
    if rank == 0:
        torch.save(scores, Path(out).parent / "titan_log_probs.pt")


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, Path]:
    """(the tiny HF checkpoint, our adapter exported from 2 FSDP ranks)."""
    tmp = tmp_path_factory.mktemp("qwen3_moe")
    hf_dir = tiny_qwen3_moe(tmp / "hf")
    run_ranks(2, _export_and_score, _toml(hf_dir), str(tmp / "adapter"))
    return hf_dir, tmp / "adapter"


def test_fsdp2_expert_adapters_match_hf_peft(exported) -> None:
    from peft import PeftModel

    hf_dir, adapter = exported
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert config["target_modules"] == ["o_proj", "q_proj", "v_proj"]
    hf = hf_model(hf_dir)
    ours = torch.load(adapter.parent / "titan_log_probs.pt")
    with torch.no_grad():
        base = hf(TOKENS).logits.log_softmax(-1)
        theirs = PeftModel.from_pretrained(hf, str(adapter)).eval()(TOKENS).logits.log_softmax(-1)
    diff, effect = (ours - theirs).abs().max().item(), (theirs - base).abs().max().item()
    print(f"qwen3_moe: max |log_softmax titan - hf+peft| = {diff:.2e}; adapter effect {effect:.2f}")
    assert effect > 0.5, f"the adapter moved the log-probs by only {effect:.3f}: this test would prove nothing"
    assert diff <= 1e-4


def test_the_base_loads_exactly_as_hf_holds_it(exported) -> None:
    hf_dir, _ = exported
    built = build_from(_toml(hf_dir, '["q_proj"]'))
    with torch.no_grad():
        ours = built.model(TOKENS)
        theirs = hf_model(hf_dir)(TOKENS).logits
    assert torch.equal(ours, theirs), (ours - theirs).abs().max().item()


def test_vllm_loads_the_per_expert_export_with_each_experts_update(exported, tmp_path) -> None:
    from safetensors.torch import load_file
    from vllm.config.lora import LoRAConfig
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.lora_weights import PackedLoRALayerWeights
    from vllm.lora.peft_helper import PEFTHelper

    _, adapter = exported
    out = to_vllm_moe(adapter, tmp_path / "vllm")
    helper = PEFTHelper.from_local_dir(str(out), max_position_embeddings=256)
    helper.validate_legal(LoRAConfig(max_lora_rank=8))
    # The modules vLLM's worker expects of its Qwen3MoeForCausalLM (worker_manager._load_adapter): its packed
    # q/k/v, o_proj, and `experts` expanded per expert (is_3d_moe_weight is False for this model).
    expected = {"q_proj", "k_proj", "v_proj", "o_proj", "experts", *(
        f"experts.{e}.{proj}" for e in range(EXPERTS) for proj in ("gate_proj", "down_proj", "up_proj"))}
    model = LoRAModel.from_local_checkpoint(str(out), expected, helper, lora_model_id=1, device="cpu",
                                            dtype=torch.float32)
    name = "model.layers.0.mlp.experts"
    packed = PackedLoRALayerWeights.pack_moe(
        [model.loras[f"{name}.{e}.{proj}"] for e in range(EXPERTS) for proj in ("gate_proj", "down_proj", "up_proj")],
        name)
    # The trainer's per-expert updates, from our PEFT export (fused gate_up: gate rows first; B interleaved).
    fused = load_file(str(adapter / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.0.mlp.experts."
    a_gu = fused[prefix + "base_layer.lora_A.weight"].view(EXPERTS, RANK, -1)
    b_gu = fused[prefix + "base_layer.lora_B.weight"].view(-1, RANK, EXPERTS).permute(2, 0, 1)
    a_dn = fused[prefix + "lora_A.weight"].view(EXPERTS, RANK, -1)
    b_dn = fused[prefix + "lora_B.weight"].view(-1, RANK, EXPERTS).permute(2, 0, 1)
    scale = ALPHA / RANK
    hidden = b_gu.shape[1] // 2
    for e in range(EXPERTS):
        want = {0: b_gu[e, :hidden] @ a_gu[e], 1: b_dn[e] @ a_dn[e], 2: b_gu[e, hidden:] @ a_gu[e]}  # w1, w2, w3
        for w, update in want.items():
            theirs = packed.scaling[w] * packed.lora_b[w][e] @ packed.lora_a[w][e]
            assert update.abs().max() > 1e-3
            torch.testing.assert_close(theirs, scale * update, rtol=1e-5, atol=1e-6)


SHARDED = ("--lora.no_replicate_adapters",)


def _one_step(rank: int, world: int, toml: str, dump: str, out: str, *layout: str) -> None:
    from titan_lora.train import TrainingRun

    cfg = job_config_from(toml + ONE_STEP_SECTIONS, f"--job.dump_folder={dump}", "--training.global_batch_size=4",
                          f"--training.local_batch_size={4 // world}", "--training.steps=1",
                          f"--data.path={REPO / 'titan_lora/data/arith_sft.jsonl'}", *layout)
    run = TrainingRun(cfg)
    try:
        randomize_adapters(run.model, seed=5)  # B != 0: A gets a gradient too
        named = adapter_params(run.model)
        before = {n: full_copy(p) for n, p in named}
        run.step = 1
        metrics = run.train_step()
        grads = {n: full_copy(p.grad) for n, p in named}
        after = {n: full_copy(p) for n, p in named}
        if rank == 0:
            torch.save({"loss": metrics["loss"], "before": before, "after": after, "grads": grads}, out)
    finally:
        run.close()


def test_one_step_on_one_rank_and_on_two_fsdp_ranks_is_the_same(tmp_path, smollm2_dir) -> None:
    """Base and expert adapters sharded by FSDP (2 experts a rank): same loss, gradients and updated adapters."""
    hf_dir = tiny_qwen3_moe(tmp_path / "hf", vocab=SMOLLM2_VOCAB, tokenizer_from=smollm2_dir)
    toml = _toml(hf_dir)
    run_ranks(1, _one_step, toml, str(tmp_path / "d1"), str(tmp_path / "one.pt"))
    run_ranks(2, _one_step, toml, str(tmp_path / "d2"), str(tmp_path / "two.pt"), *SHARDED)
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert abs(one["loss"] - two["loss"]) <= 1e-5, (one["loss"], two["loss"])
    experts = [n for n in one["after"] if "experts" in n]
    assert len(experts) == 4 and list(one["after"]) == list(two["after"])
    for name in one["after"]:
        torch.testing.assert_close(one["before"][name], two["before"][name], rtol=0, atol=0)
        g1, g2 = one["grads"][name], two["grads"][name]
        assert g1.abs().sum() > 0, f"{name} got no gradient"
        assert (g1 - g2).abs().max() <= 1e-4 * g1.abs().max(), name
        assert (one["after"][name] - one["before"][name]).abs().max() > 1e-4, f"{name} did not move"
        assert (one["after"][name] - two["after"][name]).abs().max() <= 1e-5, name
