"""`[lora] target_modules`: all-linear, HF names, the output head, and names that match nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from model_helpers import DEBUG_LORA, build_from

from titan_lora.lora.layer import LoRALayer, lora_modules
from titan_lora.lora.targets import hf_leaf_names, resolve_targets
from titan_lora.models.llama3 import LLAMA3

ALL_LINEAR_LEAVES = ["w1", "w2", "w3", "wk", "wo", "wq", "wv"]



class Tiny(nn.Module):
    """A model with attention/FFN linears, an output head and an embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(10, 4)
        self.block = nn.ModuleDict({"wq": nn.Linear(4, 4), "w2": nn.Linear(4, 4)})
        self.norm = nn.LayerNorm(4)
        self.lm_head = nn.Linear(4, 10)


def _targets(toml: str) -> list[str]:
    return [name for name, _ in lora_modules(build_from(toml).model)]


def _with_targets(value: str) -> str:
    return DEBUG_LORA.replace('target_modules = "all-linear"', f"target_modules = {value}")


def test_all_linear_excludes_the_output_head_and_embeddings() -> None:
    assert resolve_targets(Tiny(), "all-linear", LLAMA3.leaf_names) == ["block.wq", "block.w2"]
    names = _targets(DEBUG_LORA)
    assert sorted({n.rsplit(".", 1)[-1] for n in names}) == ALL_LINEAR_LEAVES
    assert len(names) == 2 * 7, "every linear of both transformer blocks"
    assert "lm_head" not in names


@pytest.mark.parametrize("head", ["lm_head"])  # 0.3.0: torchtitan and HF both name the head lm_head
def test_the_output_head_is_adapted_when_named(head: str) -> None:
    assert resolve_targets(Tiny(), [head], LLAMA3.leaf_names) == ["lm_head"]
    model = build_from(_with_targets(f'["{head}", "wq"]')).model
    assert isinstance(model.lm_head, LoRALayer)
    assert model.lm_head.lora_B.shape == (49152, 8) and model.lm_head.lora_A.shape == (8, 64)
    assert [n for n, _ in lora_modules(model)] == ["layers.0.attention.qkv_linear.wq",
                                                   "layers.1.attention.qkv_linear.wq", "lm_head"]
    with torch.no_grad():
        assert model(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, 49152)


def test_hf_names_are_accepted_and_mean_the_same_linears() -> None:
    hf = _targets(_with_targets('["q_proj", "v_proj", "down_proj"]'))
    titan = _targets(_with_targets('["wq", "wv", "w2"]'))
    assert hf == titan == [
        "layers.0.attention.qkv_linear.wq", "layers.0.attention.qkv_linear.wv", "layers.0.feed_forward.w2",
        "layers.1.attention.qkv_linear.wq", "layers.1.attention.qkv_linear.wv", "layers.1.feed_forward.w2",
    ]
    assert _targets(_with_targets('["q_proj", "wv"]')) == [n for n in hf if not n.endswith("w2")], "mixed naming"
    names = LLAMA3.leaf_names
    assert hf_leaf_names(hf, names) == ["down_proj", "q_proj", "v_proj"]


def test_hf_leaf_names_of_all_linear() -> None:
    assert hf_leaf_names(_targets(DEBUG_LORA), LLAMA3.leaf_names) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


def test_a_target_that_matches_nothing_names_the_key_and_the_choices() -> None:
    with pytest.raises(ValueError) as err:
        resolve_targets(Tiny(), ["wq", "qproj"], LLAMA3.leaf_names)
    message = str(err.value)
    assert "[lora] target_modules" in message and "'qproj'" in message
    assert "wq" in message and "w2" in message, "the message lists the linears the model has"
    assert "all-linear" in message


def test_torchtitan_022s_head_name_is_refused_with_its_new_name() -> None:
    with pytest.raises(ValueError, match="torchtitan 0.3.0 names the output head lm_head .*: write lm_head"):
        resolve_targets(Tiny(), ["wq", "output"], LLAMA3.leaf_names)


@pytest.mark.parametrize("targets", ['"all-linear"', '["q_proj", "wv", "lm_head"]'])
def test_targets_resolved_from_the_config_name_the_built_adapters(targets: str) -> None:
    # A resume compares the checkpoint's adapted modules with the config's before the build: both
    # sides must name them alike.
    from model_helpers import job_config_from

    from titan_lora.trainer.job_config import check_targets

    toml = _with_targets(targets).replace('mode = "none"', 'mode = "full"')  # AC wraps every block
    assert check_targets(job_config_from(toml)) == _targets(toml)
