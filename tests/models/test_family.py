"""The model-family plug-in point: `[model] name` selects a registered family, whose flavors, leaf names
and RoPE rows reach target resolution, the build, and the adapter snapshot; unknown names are refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from model_helpers import DEBUG_LORA, build_from, job_config_from, randomize_adapters

from titan_lora.export.peft import PEFT_PREFIX, hf_rope_permute
from titan_lora.lora.layer import adapter_params
from titan_lora.models.family import (
    ModelFamily, families_for_model_type, model_family, register_model_family, registered_model_families,
)
from titan_lora.model_shape import DecoderShape
from titan_lora.models.llama3 import HF_MODULES, LLAMA3
from titan_lora.models.smollm2 import SMOLLM2, pretrained_dir
from titan_lora.sync.adapter_source import AdapterSource

# A Llama 3 variant as a plug-in would write it: its own flavor, an HF naming whose attention
# projections are query/key/value/dense, and rotate-half rows in the trainer (no RoPE permutation).
RENAMED_HF = {"wq": "query", "wk": "key", "wv": "value", "wo": "dense"}
TINY = DecoderShape(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, ffn_hidden_dim=96,
                    vocab_size=49152, norm_eps=1e-5, rope_theta=1e5)


def _renamed(titan: str, hf: str) -> str:
    leaf = titan.rsplit(".", 1)[-1]
    return f"{hf.rsplit('.', 1)[0]}.{RENAMED_HF[leaf]}" if leaf in RENAMED_HF else hf


RENAMED = register_model_family(ModelFamily(
    name="test_llama3_renamed",
    architecture=LLAMA3.architecture,
    flavors={"tiny": TINY},
    hf_modules={titan: _renamed(titan, hf) for titan, hf in HF_MODULES.items()},
    rope_rows=lambda shape: {},
    default_assets=SMOLLM2.default_assets,
))
RENAMED_TOML = DEBUG_LORA.replace('name = "smollm2"', f'name = "{RENAMED.name}"').replace(
    'flavor = "debug"', 'flavor = "tiny"').replace('"all-linear"', '["query", "value", "w2"]')


def test_the_built_in_names_select_the_llama3_families() -> None:
    assert {"smollm2", "llama3_lora", RENAMED.name} <= set(registered_model_families())
    assert model_family("smollm2") is SMOLLM2 and model_family("llama3_lora") is LLAMA3
    assert model_family("titan_lora.models.llama3:LLAMA3") is LLAMA3, "a plug-in by module path"
    assert sorted(SMOLLM2.flavors) == ["135M", "debug"]
    assert {"8B", "70B"} <= set(LLAMA3.flavors) and "8B_flex" not in LLAMA3.flavors, "attention titan_lora runs"
    assert LLAMA3.leaf_names["wq"] == "q_proj" and LLAMA3.leaf_names["lm_head"] == "lm_head"


def test_the_families_that_load_a_model_type_are_named_once() -> None:
    assert families_for_model_type("llama") == ["llama3", "smollm2"], "no old alias, own-asset families last"
    assert families_for_model_type("qwen3") == ["qwen3"] and families_for_model_type("gpt2") == []


def test_the_hf_directory_comes_from_the_family() -> None:
    assert SMOLLM2.hf_dir("/ignored", need_weights=False) == str(pretrained_dir(need_weights=False))
    assert LLAMA3.hf_dir("/ckpt/llama", need_weights=True) == "/ckpt/llama"


def test_an_unknown_model_name_is_refused_naming_the_registered_ones() -> None:
    with pytest.raises(ValueError) as err:
        job_config_from(DEBUG_LORA.replace('name = "smollm2"', 'name = "smolm2"'))
    message = str(err.value)
    for fragment in ("[model] name = 'smolm2' is not registered", "llama3_lora", "smollm2", RENAMED.name,
                     "package.module:attribute"):
        assert fragment in message, f"{fragment!r} missing from {message!r}"


def test_a_family_named_by_module_path_is_selected_without_registration() -> None:
    toml = DEBUG_LORA.replace('name = "smollm2"', 'name = "titan_lora.models.llama3:LLAMA3"').replace(
        'flavor = "debug"', 'flavor = "debugmodel"')
    assert job_config_from(toml).model.name == "titan_lora.models.llama3:LLAMA3"


def test_an_unknown_flavor_names_the_familys_flavors() -> None:
    with pytest.raises(ValueError, match=r"\[model\] flavor = 'debug' is unknown .*\['tiny'\]"):
        job_config_from(RENAMED_TOML.replace('flavor = "tiny"', 'flavor = "debug"'))


def test_targets_are_resolved_in_the_selected_familys_hf_names() -> None:
    with pytest.raises(ValueError) as err:  # Llama's HF name means nothing to this family
        job_config_from(RENAMED_TOML.replace('"query"', '"q_proj"'))
    assert "'q_proj'" in str(err.value) and "query" in str(err.value)


def test_a_registered_family_is_built_named_and_laid_out_by_its_own_description() -> None:
    built = build_from(RENAMED_TOML)
    assert len(built.model.layers) == 1 and built.model.tok_embeddings.weight.shape == (49152, 32)
    assert built.model.layers["0"].feed_forward.w1.weight.shape == (96, 32), "the flavor's FFN width"
    randomize_adapters(built.model)
    params = dict(adapter_params(built.model))
    modules = ("attention.qkv_linear.wq", "attention.qkv_linear.wv", "feed_forward.w2")
    assert sorted(params) == sorted(f"layers.0.{m}.lora_{ab}" for m in modules for ab in "AB")
    source = AdapterSource(built.model, built.peft_layout, job_config_from(RENAMED_TOML).lora)
    payload = source.snapshot(version=1)
    attn = f"{PEFT_PREFIX}model.layers.0.self_attn"
    assert payload.peft_config["target_modules"] == ["down_proj", "query", "value"]
    mlp = f"{PEFT_PREFIX}model.layers.0.mlp"
    hf_modules = (f"{attn}.query", f"{attn}.value", f"{mlp}.down_proj")
    assert set(payload.tensors) == {f"{m}.lora_{ab}.weight" for m in hf_modules for ab in "AB"}
    wq_b = params["layers.0.attention.qkv_linear.wq.lora_B"]
    # The family keeps rotate-half rows: no permutation, where Llama's layout would permute them.
    assert torch.equal(payload.tensors[f"{attn}.query.lora_B.weight"], wq_b)
    assert not torch.equal(hf_rope_permute(wq_b, 2, 16), wq_b)


def test_a_family_registers_once() -> None:
    with pytest.raises(ValueError, match="model family 'smollm2' is already registered"):
        register_model_family(dataclasses.replace(SMOLLM2))
