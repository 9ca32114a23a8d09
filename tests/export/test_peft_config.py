"""The PEFT directory that PEFT, vLLM and SGLang read: exact config, names outside layers, nested paths."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from titan_lora.config import LoRA
from titan_lora.export.peft import (
    RopeRows, hf_rope_permute, peft_config, peft_name_and_rope, save_peft_dir, titan_rope_permute,
)
from titan_lora.model_shape import DecoderShape
from titan_lora.models.llama3 import LLAMA3


def test_peft_config_is_exactly_the_lora_section() -> None:
    cfg = peft_config(LoRA(rank=4, alpha=8.0, use_rslora=True, dropout=0.1), ["q_proj", "v_proj"], "/m")
    assert cfg == {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "/m", "r": 4,
        "lora_alpha": 8.0, "use_rslora": True, "lora_dropout": 0.1, "target_modules": ["q_proj", "v_proj"],
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "modules_to_save": None,
    }
    assert peft_config(LoRA(), ["q_proj"])["base_model_name_or_path"] == ""


def test_saved_directory_round_trips_through_peft(tmp_path) -> None:
    from peft import LoraConfig, PeftConfig

    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 8),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(8, 4)}
    out = save_peft_dir(tmp_path / "adapter", tensors, peft_config(LoRA(rank=4, alpha=8.0), ["q_proj"]))
    assert out == tmp_path / "adapter"
    loaded = PeftConfig.from_pretrained(str(out))
    assert isinstance(loaded, LoraConfig)
    assert (loaded.r, loaded.lora_alpha, loaded.target_modules, loaded.task_type) == (4, 8.0, {"q_proj"},
                                                                                       "CAUSAL_LM")
    on_disk = load_file(str(out / "adapter_model.safetensors"))
    assert on_disk.keys() == tensors.keys()
    assert all(torch.equal(on_disk[k], v) for k, v in tensors.items())
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4


def test_save_writes_contiguous_cpu_copies(tmp_path) -> None:
    t = torch.arange(12.0).view(3, 4).t()  # non-contiguous: safetensors refuses it as is
    save_peft_dir(tmp_path, {"x.lora_A.weight": t}, {"r": 1})
    assert torch.equal(load_file(str(tmp_path / "adapter_model.safetensors"))["x.lora_A.weight"], t)


def test_peft_names_of_modules_outside_the_layers_and_their_head_counts() -> None:
    layout = LLAMA3.peft_layout(DecoderShape(dim=64, n_layers=12, n_heads=4, n_kv_heads=2, head_dim=16,
                                                ffn_hidden_dim=192, vocab_size=256, norm_eps=1e-5, rope_theta=1e4))
    lm_head = ("base_model.model.lm_head.lora_B.weight", None)
    assert peft_name_and_rope("lm_head.lora_B", layout) == lm_head
    assert peft_name_and_rope("layers.11.attention.qkv_linear.wk.lora_B", layout) == (
        "base_model.model.model.layers.11.self_attn.k_proj.lora_B.weight", RopeRows(n_heads=2, head_dim=16))
    assert peft_name_and_rope("layers.3.attention.qkv_linear.wq.lora_B", layout)[1] == RopeRows(n_heads=4, head_dim=16)
    assert peft_name_and_rope("layers.3.attention.qkv_linear.wq.lora_A", layout)[1] is None


def test_save_creates_missing_parent_directories(tmp_path) -> None:
    nested = tmp_path / "runs" / "step-3" / "adapter"
    out = save_peft_dir(nested, {"x.lora_A.weight": torch.ones(2, 2)}, {"r": 2})
    assert json.loads((out / "adapter_config.json").read_text()) == {"r": 2}


def test_the_rope_permutation_goes_by_head_dim_not_by_the_model_width() -> None:
    # Qwen3-like: 2 heads of 4 rows (8 rows) whatever dim / n_heads is; pairs (0,1), (2,3) -> 0, 2, 1, 3.
    rows = torch.arange(8.0).view(8, 1).expand(8, 3)
    hf = hf_rope_permute(rows, n_heads=2, head_dim=4)
    assert hf[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert torch.equal(titan_rope_permute(hf, n_heads=2, head_dim=4), rows)
    with pytest.raises(ValueError, match="cannot RoPE-permute 8 rows as 2 heads of 8"):
        hf_rope_permute(rows, n_heads=2, head_dim=8)
