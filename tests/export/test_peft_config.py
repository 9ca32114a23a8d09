"""The adapter_config.json that PEFT, vLLM and SGLang read: exact keys and values, and peft accepts it."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from titan_lora.config import LoRA
from titan_lora.export.peft import peft_config, save_peft_dir


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
