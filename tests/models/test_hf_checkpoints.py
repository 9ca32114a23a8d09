"""`[model] hf_assets_path`: any family's HF checkpoint loads with its shape read from config.json (single
or sharded safetensors, tied or untied head), and what cannot work is refused while the config is read,
naming the fix: another family's config.json, a tokenizer larger than the model's vocabulary, missing
weights. On 2 CPU ranks a pretrained build is quiet about DTensor's per-rank random init (it is replaced)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from dist_helpers import run_ranks
from model_helpers import DEBUG_LORA, build_from, job_config_from
from tiny_checkpoints import SMOLLM2_VOCAB, hf_model, hf_toml, tiny_llama, tiny_qwen3

from titan_lora.model_shape import DecoderShape
from titan_lora.models.llama3 import shape_from_hf as llama_shape
from titan_lora.models.qwen3 import shape_from_hf as qwen3_shape
from titan_lora.models.llama3 import LLAMA3
from titan_lora.models.qwen3 import QWEN3
from titan_lora.models.resolve import resolve_model
from titan_lora.models.smollm2 import FLAVORS, SMOLLM2

TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


def _shapes(family, shape: DecoderShape) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in family.architecture.meta_model(shape).named_parameters()}


def test_smollm2s_config_json_gives_the_shape_of_its_flavor(smollm2_dir: Path) -> None:
    shape = llama_shape(json.loads((smollm2_dir / "config.json").read_text()))
    assert _shapes(SMOLLM2, shape) == _shapes(SMOLLM2, FLAVORS["135M"])
    assert (shape.rope_theta, shape.rope_scaling, shape.tied) == (1e5, None, True)


def test_an_ffn_narrower_than_torchtitans_default_keeps_its_size() -> None:
    # int(8 * 64 / 3) = 170 > 160: torchtitan needs ffn_dim_multiplier to land on 160.
    config = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1, "intermediate_size": 160,
              "vocab_size": 256, "rope_theta": 1e4}
    shapes = _shapes(SMOLLM2, llama_shape(config))
    assert shapes["layers.0.feed_forward.w1.weight"] == (160, 64)


def test_qwen3_shapes_keep_head_dim_norms_and_tying() -> None:
    config = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
              "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 256, "rms_norm_eps": 1e-6,
              "rope_theta": 1e6, "tie_word_embeddings": True}
    shape = qwen3_shape(config)
    assert (shape.head_dim, shape.qk_norm, shape.tied, shape.rope_theta) == (32, True, True, 1e6)
    built = _shapes(QWEN3, shape)  # what torchtitan's Qwen3 builds of it
    assert built["layers.0.attention.qkv_linear.wq.weight"] == (4 * 32, 64) and built["layers.0.attention.q_norm.weight"] == (32,)
    assert built["layers.0.feed_forward.w1.weight"] == (128, 64)
    assert "lm_head.weight" not in built, "the tied head is the embedding (one parameter)"
    with pytest.raises(ValueError, match="rope_type = 'yarn'.*another family"):
        qwen3_shape({**config, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="attention_bias = True"):
        llama_shape({**config, "attention_bias": True, "head_dim": 16})
    with pytest.raises(ValueError, match="no q/k norms.*qwen3"):
        LLAMA3.architecture.to_config(dataclasses.replace(shape, head_dim=16))
    with pytest.raises(ValueError, match="head_dim = dim / n_heads = 16.*32"):
        LLAMA3.architecture.to_config(dataclasses.replace(shape, qk_norm=False))


@pytest.mark.parametrize("name, make, tied", [("llama3", tiny_llama, True), ("qwen3", tiny_qwen3, False),
                                              ("qwen3", tiny_qwen3, True)])
def test_a_checkpoint_loads_with_no_flavor_and_matches_hf(tmp_path: Path, name: str, make, tied: bool) -> None:
    hf_dir = make(tmp_path / name, tied=tied)
    built = build_from(hf_toml(name, hf_dir))
    with torch.no_grad():
        diff = (built.model(TOKENS).log_softmax(-1) - hf_model(hf_dir)(TOKENS).logits.log_softmax(-1)).abs().max()
    assert diff <= 1e-5, f"{name}: base log_softmax differs from HF by {diff:.2e}"


def test_a_sharded_checkpoint_with_an_index_loads(tmp_path: Path) -> None:
    hf_dir = tiny_llama(tmp_path / "sharded", shard_mb=0.05)
    shards = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    assert (hf_dir / "model.safetensors.index.json").exists() and len(shards) >= 2, shards
    built = build_from(hf_toml("llama3", hf_dir))
    assert built.model.layers["1"].attention.qkv_linear.wk.weight.shape == (32, 64)  # GQA: 2 KV heads of 16
    with torch.no_grad():
        diff = (built.model(TOKENS).log_softmax(-1) - hf_model(hf_dir)(TOKENS).logits.log_softmax(-1)).abs().max()
    assert diff <= 1e-5


@pytest.mark.parametrize("name, make, right", [("qwen3", tiny_llama, "llama3"), ("llama3", tiny_qwen3, "qwen3")])
def test_a_config_json_of_another_family_names_the_right_model_name(tmp_path: Path, name, make, right) -> None:
    hf_dir = make(tmp_path / "other")
    with pytest.raises(ValueError) as err:
        job_config_from(hf_toml(name, hf_dir))
    message = str(err.value)
    assert f"[model] name = {name!r}" in message and f"set [model] name = {right!r}" in message, message


def test_a_tokenizer_larger_than_the_checkpoints_vocabulary_is_refused(tmp_path: Path, smollm2_dir: Path) -> None:
    hf_dir = tiny_qwen3(tmp_path / "q", vocab=1024, tokenizer_from=smollm2_dir)
    with pytest.raises(ValueError) as err:
        job_config_from(hf_toml("qwen3", hf_dir))
    message = str(err.value)
    assert f"has {SMOLLM2_VOCAB} tokens" in message and "vocabulary holds 1024" in message, message
    assert "use the tokenizer that came with these weights" in message


def test_a_random_init_flavor_smaller_than_the_tokenizer_is_refused_naming_the_fix(smollm2_dir: Path) -> None:
    # The case: torchtitan's llama3 "debugmodel" (vocabulary 2048) with a real tokenizer crashed
    # with an IndexError in the first forward.
    toml = hf_toml("llama3", smollm2_dir).replace("load_pretrained = true", 'load_pretrained = false\nflavor = "debugmodel"')
    with pytest.raises(ValueError) as err:
        job_config_from(toml)
    message = str(err.value)
    assert "vocabulary holds 2048" in message and f"flavor with vocab_size >= {SMOLLM2_VOCAB}" in message, message
    assert resolve_model(job_config_from(toml.replace('"debugmodel"', '"8B"')).model).shape.vocab_size == 128256


def test_missing_weights_are_refused_before_the_model_is_built(tmp_path: Path) -> None:
    sharded = tiny_llama(tmp_path / "sharded", shard_mb=0.05)
    lost = sorted(sharded.glob("*.safetensors"))[1]
    lost.unlink()
    with pytest.raises(ValueError, match=f"names 1 shard.*{lost.name}.*copy every shard"):
        job_config_from(hf_toml("llama3", sharded))

    empty = tmp_path / "config-only"
    empty.mkdir()
    shutil.copy(sharded / "config.json", empty / "config.json")
    with pytest.raises(ValueError, match=r"no \*\.safetensors .*load_pretrained = false"):
        job_config_from(hf_toml("llama3", empty))

    partial = tiny_qwen3(tmp_path / "partial")
    from safetensors.torch import load_file, save_file

    state = load_file(str(partial / "model.safetensors"))
    del state["model.layers.1.self_attn.k_norm.weight"], state["lm_head.weight"]
    save_file(state, str(partial / "model.safetensors"))
    with pytest.raises(ValueError) as err:
        job_config_from(hf_toml("qwen3", partial))
    message = str(err.value)
    assert "lacks 2 weights" in message and "layers.1.attention.k_norm.weight" in message, message
    assert "tie_word_embeddings" in message, "an untied head that is missing should say how a tied one is declared"


def test_a_family_with_its_own_checkpoint_refuses_another_path(tmp_path: Path) -> None:
    toml = hf_toml("smollm2", tmp_path).replace("load_pretrained = true", 'load_pretrained = false\nflavor = "debug"')
    with pytest.raises(ValueError, match="'smollm2' brings its own checkpoint.*name = 'llama3'"):
        job_config_from(toml)


def test_tying_follows_the_model_not_a_config_json_of_another_shape(tmp_path: Path) -> None:
    untied = tiny_qwen3(tmp_path / "untied", tied=False)
    random_init = hf_toml("qwen3", untied).replace("load_pretrained = true",
                                                   'load_pretrained = false\nflavor = "debug"')
    built = build_from(random_init)
    assert built.tied and built.model.lm_head.weight is built.model.tok_embeddings.weight, \
        "the debug flavor ties its head, whatever hf_assets_path's config.json says"
    assert not build_from(hf_toml("qwen3", untied)).tied, "loaded: config.json's tie_word_embeddings"
    assert build_from(hf_toml("llama3", tiny_llama(tmp_path / "tied", tied=True))).tied


DTENSOR_RANDOM = "DTensor random operators may not have complete support on cpu device mesh"


def _dtensor_random_warned(toml: str) -> bool:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        build_from(toml)
    return any(str(w.message) == DTENSOR_RANDOM for w in seen)


def _builds(rank: int, world: int, pretrained: str) -> None:
    assert not _dtensor_random_warned(pretrained), f"rank {rank}: the pretrained base's init is replaced"
    assert _dtensor_random_warned(DEBUG_LORA), f"rank {rank}: a random base depends on the sharding"


def test_a_pretrained_build_on_two_cpu_ranks_hides_only_the_random_init_warning(tmp_path: Path) -> None:
    run_ranks(2, _builds, hf_toml("llama3", tiny_llama(tmp_path / "llama3")))
