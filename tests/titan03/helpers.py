"""Shared pieces of the torchtitan 0.3.0 prototype tests (tests/titan03): tiny HF models + peft, the
0.3.0 LoRA model loaded from them, adapter copies between the two."""

from __future__ import annotations

import importlib.metadata

import pytest


def require_torchtitan_03() -> None:
    """Skip the calling test module unless torchtitan 0.3.x is importable (the main suite runs on 0.2.2)."""
    try:
        version = importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("torchtitan is not installed", allow_module_level=True)
    if not version.startswith("0.3."):
        pytest.skip(f"torchtitan {version}: these tests need 0.3.x (PYTHONPATH overlay)", allow_module_level=True)


HF_TO_TITAN = {  # HF leaf module path (under model.layers.{i}.) -> 0.3.0 module path (under layers.{i}.)
    "self_attn.q_proj": "attention.qkv_linear.wq",
    "self_attn.k_proj": "attention.qkv_linear.wk",
    "self_attn.v_proj": "attention.qkv_linear.wv",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_hf(family: str):
    """A tiny random HF causal LM in fp32 (seeded)."""
    import torch
    import transformers

    torch.manual_seed(0)
    common = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=1000, max_position_embeddings=256,
    )
    if family == "llama3":
        cfg = transformers.LlamaConfig(
            **common, rms_norm_eps=1e-5, tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
            },
        )
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(
            **common, head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
        model = transformers.Qwen3ForCausalLM(cfg)
    model.config._attn_implementation = "eager"
    # Random norms too (HF inits them to ones), so a wrong norm mapping shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.float().eval()


def row_permute(family: str, titan_name: str, shape, n_heads: int, n_kv_heads: int):
    """A function mapping an HF-row-order tensor (rows = output features) to torchtitan's for this linear:
    Llama's q/k rows are reverse-permuted by 0.3.0's Llama3StateDictAdapter (ComplexRoPE, interleaved),
    so lora_B rows (and their grads) must be too; Qwen3 (CosSinRoPE) keeps HF's order."""
    leaf = titan_name.rsplit(".", 1)[-1]
    if family != "llama3" or leaf not in ("wq", "wk"):
        return lambda t: t
    heads = n_heads if leaf == "wq" else n_kv_heads

    def permute(t):
        out, cols = t.shape
        return t.view(heads, 2, out // heads // 2, cols).transpose(1, 2).reshape(out, cols)

    return permute
