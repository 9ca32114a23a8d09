"""Checkpoint keys: adapter parameters and their optimizer state renamed to PEFT names and back."""

from __future__ import annotations

import pytest

from titan_lora.export.peft import PeftLayout
from titan_lora.trainer.checkpoint_names import (
    from_torchtitan_022,
    hf_targets,
    peft_names,
    renamed_optimizer_state,
    renamed_params,
    saved_hf_targets,
    to_torchtitan_022,
)

LAYOUT = PeftLayout(hf_modules={"layers.{}.attention.wq": "model.layers.{}.self_attn.q_proj",
                                "layers.{}.feed_forward.w1": "model.layers.{}.mlp.gate_proj"}, rope={})
FQNS = ["layers.0.attention.wq.lora_A", "layers.0.attention.wq.lora_B", "layers.11.feed_forward.w1.lora_A"]


def test_parameters_and_their_optimizer_state_get_peft_names_and_come_back() -> None:
    names = peft_names(FQNS, LAYOUT)
    assert names["layers.11.feed_forward.w1.lora_A"] == "base_model.model.model.layers.11.mlp.gate_proj.lora_A.weight"
    assert renamed_params({"layers.0.attention.wq.lora_B": 1}, names) == {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": 1}
    optimizer = {"state.layers.0.attention.wq.lora_A.exp_avg": 1, "state.layers.0.attention.wq.lora_A.step": 2,
                 "param_groups.layers.11.feed_forward.w1.lora_A.lr": 3e-4,
                 "param_groups.layers.11.feed_forward.w1.lora_A.betas": (0.9, 0.95)}
    stored = renamed_optimizer_state(optimizer, names)
    assert stored["state.base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight.exp_avg"] == 1
    assert stored["param_groups.base_model.model.model.layers.11.mlp.gate_proj.lora_A.weight.betas"] == (0.9, 0.95)
    assert renamed_optimizer_state(stored, {v: k for k, v in names.items()}) == optimizer


def test_an_optimizer_key_of_no_adapter_parameter_is_an_error_naming_it() -> None:
    with pytest.raises(KeyError, match="layers.0.attention.wk.lora_A.exp_avg"):
        renamed_optimizer_state({"state.layers.0.attention.wk.lora_A.exp_avg": 0}, peft_names(FQNS, LAYOUT))
    with pytest.raises(KeyError, match="'exp_avg'"):
        renamed_optimizer_state({"exp_avg": 0}, peft_names(FQNS, LAYOUT))


def test_two_parameters_on_one_peft_name_are_refused() -> None:
    clash = PeftLayout(hf_modules={"layers.{}.attention.wq": "model.layers.{}.self_attn.q_proj",
                                   "layers.{}.attention.wk": "model.layers.{}.self_attn.q_proj"}, rope={})
    with pytest.raises(ValueError, match="PeftLayout is wrong"):
        peft_names(["layers.0.attention.wq.lora_A", "layers.0.attention.wk.lora_A"], clash)


@pytest.mark.parametrize(("old", "new"), [
    ("layers.0.attention.wq", "layers.0.attention.qkv_linear.wq"),
    ("layers.11.attention.wv.lora_B", "layers.11.attention.qkv_linear.wv.lora_B"),
    ("layers.3.attention.wk.lora_A", "layers.3.attention.qkv_linear.wk.lora_A"),
    ("output", "lm_head"), ("output.lora_A", "lm_head.lora_A"),
    ("layers.0.attention.wo", "layers.0.attention.wo"), ("layers.2.feed_forward.w1.lora_A", "layers.2.feed_forward.w1.lora_A"),
    ("tok_embeddings", "tok_embeddings"), ("layers.0.attention_norm", "layers.0.attention_norm"),
])
def test_torchtitan_022_module_paths_map_to_030_and_back(old: str, new: str) -> None:
    assert from_torchtitan_022(old) == new
    assert to_torchtitan_022(new) == old


def test_signatures_compare_by_hf_module_names_whichever_release_wrote_them() -> None:
    hf_modules = {"layers.{}.attention.qkv_linear.wq": "model.layers.{}.self_attn.q_proj",
                  "layers.{}.feed_forward.w1": "model.layers.{}.mlp.gate_proj", "lm_head": "lm_head"}
    ours = hf_targets(["layers.1.feed_forward.w1", "layers.0.attention.qkv_linear.wq", "lm_head"], hf_modules)
    assert ours == ["lm_head", "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.gate_proj"]
    written_on_022 = {"lora_rank": 8, "target_modules": ["layers.0.attention.wq", "layers.1.feed_forward.w1", "output"]}
    assert saved_hf_targets(written_on_022, hf_modules) == ours
    assert saved_hf_targets({"lora_rank": 8, "target_modules": ours, "targets": "hf"}, hf_modules) == ours
    unknown = {"lora_rank": 8, "target_modules": ["layers.0.attention.wq", "layers.0.moe.router"]}
    assert saved_hf_targets(unknown, hf_modules) == ["layers.0.moe.router", "model.layers.0.self_attn.q_proj"]
