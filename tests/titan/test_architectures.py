"""The seam's architectures: a `DecoderShape` becomes torchtitan's model with exactly that shape, torchtitan's
own flavors come back as the shapes that build them, and what an architecture cannot build is refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from model_helpers import DEBUG_LORA, job_config_from

from titan_lora.model_shape import DecoderShape, RopeScaling
from titan_lora.titan.llama3 import LLAMA3
from titan_lora.titan.qwen3 import QWEN3

LLAMA = DecoderShape(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_hidden_dim=160, vocab_size=256,
                     norm_eps=1e-5, rope_theta=1e4)


def _param_shapes(architecture, shape: DecoderShape) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in architecture.meta_model(shape).named_parameters()}


@pytest.mark.parametrize("ffn", [160, 170, 192, 1000], ids=lambda f: f"ffn{f}")
def test_a_llama_shape_builds_its_ffn_width_whatever_torchtitans_rounding(ffn: int) -> None:
    # int(8 * 64 / 3) = 170: narrower, equal to and wider than torchtitan's own width
    shapes = _param_shapes(LLAMA3, dataclasses.replace(LLAMA, ffn_hidden_dim=ffn))
    assert shapes["layers.0.feed_forward.w1.weight"] == (ffn, 64)
    assert shapes["layers.1.attention.qkv_linear.wk.weight"] == (2 * 16, 64) and shapes["lm_head.weight"] == (256, 64)


@pytest.mark.parametrize("architecture", [LLAMA3, QWEN3], ids=lambda a: a.name)
def test_torchtitans_flavors_come_back_as_the_shapes_that_build_them(architecture) -> None:
    for name, shape in architecture.flavors.items():
        small = dataclasses.replace(shape, n_layers=1)  # the widths are what is checked; one layer is cheap
        rebuilt = architecture.to_config(small)
        original = architecture.titan_flavors[name]()
        original.layers = original.layers[:1]
        ours = _param_shapes(architecture, small)
        with torch.device("meta"):
            theirs = original.build()
        # torchtitan's flavors fuse q/k/v into one `wqkv`: compare them split as titan_lora builds them
        assert ours == _unfused({n: tuple(p.shape) for n, p in theirs.named_parameters()}, shape), name
        ours_rope, their_rope = rebuilt.layers[0].attention.rope, original.layers[0].attention.rope
        assert ours_rope.theta == their_rope.theta and rebuilt.norm.eps == original.norm.eps, name


def _unfused(shapes: dict[str, tuple[int, ...]], shape: DecoderShape) -> dict[str, tuple[int, ...]]:
    out = {}
    for name, size in shapes.items():
        if name.endswith("qkv_linear.wqkv.weight"):
            prefix = name.removesuffix("wqkv.weight")
            q, kv = shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
            assert size == (q + 2 * kv, shape.dim), name
            out.update({prefix + "wq.weight": (q, shape.dim), prefix + "wk.weight": (kv, shape.dim),
                        prefix + "wv.weight": (kv, shape.dim)})
        else:
            out[name] = size
    return out


def test_llamas_rope_scaling_is_kept_and_one_means_none() -> None:
    eight_b = LLAMA3.flavors["8B"]
    assert eight_b.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192) and eight_b.ffn_hidden_dim == 14336
    assert LLAMA3.to_config(LLAMA).layers[0].attention.rope.scaling == "none", "unscaled: torchtitan's 'none'"
    assert "8B_flex" not in LLAMA3.flavors, "attention that needs masks titan_lora does not pass"


def test_what_an_architecture_cannot_build_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="head_dim = dim / n_heads = 16, but the shape asks for 32"):
        LLAMA3.to_config(dataclasses.replace(LLAMA, head_dim=32))
    with pytest.raises(ValueError, match="no q/k norms"):
        LLAMA3.to_config(dataclasses.replace(LLAMA, qk_norm=True))
    with pytest.raises(ValueError, match="does not scale RoPE"):
        QWEN3.to_config(dataclasses.replace(LLAMA, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192)))
    with pytest.raises(ValueError, match="4 attention heads cannot be grouped over 3"):
        dataclasses.replace(LLAMA, n_kv_heads=3)


def test_a_tied_qwen3_shares_its_head_and_a_job_sets_the_sequence_length() -> None:
    shape = dataclasses.replace(LLAMA, head_dim=32, qk_norm=True, tied=True)
    assert "lm_head.weight" not in _param_shapes(QWEN3, shape)
    assert "lm_head.weight" in _param_shapes(QWEN3, dataclasses.replace(shape, tied=False))

    job = job_config_from(DEBUG_LORA, "--training.seq_len", "96")
    assert LLAMA3.model_config(LLAMA).layers[0].attention.rope.max_seq_len == LLAMA.max_seq_len
    assert LLAMA3.model_config(LLAMA, job).layers[0].attention.rope.max_seq_len == 96, "[training] seq_len"
    assert QWEN3.meta_model(shape, job).layers["0"].attention.rope.cache.shape[0] == 96
