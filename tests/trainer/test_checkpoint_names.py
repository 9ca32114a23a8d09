"""Checkpoint keys: adapter parameters and their optimizer state renamed to PEFT names and back."""

from __future__ import annotations

import pytest

from titan_lora.export.peft import PeftLayout
from titan_lora.trainer.checkpoint_names import peft_names, renamed_optimizer_state, renamed_params

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
