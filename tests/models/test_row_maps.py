"""The row maps come from the family's own state-dict adapter, and a slice read through them is the adapter's
output cut, for every row window (one process, no model built)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from titan_lora.model_shape import DecoderShape
from titan_lora.models.llama3 import LLAMA3
from titan_lora.models.qwen3 import QWEN3
from titan_lora.models.row_maps import row_maps
from titan_lora.models.slices import SliceReader

LLAMA = DecoderShape(dim=64, n_layers=1, n_heads=4, n_kv_heads=1, head_dim=16, ffn_hidden_dim=192, vocab_size=33,
                     norm_eps=1e-5, rope_theta=1e4)
Q, K = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"


def _llama_shapes() -> dict[str, tuple[int, ...]]:
    return {"model.embed_tokens.weight": (33, 64), Q: (64, 64), K: (16, 64),
            "model.layers.0.self_attn.o_proj.weight": (64, 64),
            "model.layers.0.input_layernorm.weight": (64,),
            "lm_head.weight": (33, 64)}


def test_llamas_q_and_k_rows_are_reordered_per_head_and_the_rest_kept() -> None:
    maps = row_maps(LLAMA3.architecture.state_dict_adapter(LLAMA, None).from_hf, _llama_shapes())
    assert {n for n, m in maps.items() if m is not None} == {"layers.{}.attention.qkv_linear.wq.weight",
                                                            "layers.{}.attention.qkv_linear.wk.weight"}
    # one head of 16: interleaved row 2j is rotate-half row j, row 2j + 1 is row 8 + j
    assert maps["layers.{}.attention.qkv_linear.wk.weight"].tolist() == [r for j in range(8) for r in (j, 8 + j)]


def test_qwen3_keeps_every_row() -> None:
    shape = DecoderShape(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=32, ffn_hidden_dim=128, vocab_size=33,
                         norm_eps=1e-6, rope_theta=1e6, qk_norm=True)
    shapes = {"model.embed_tokens.weight": (33, 64), Q: (128, 64), K: (64, 64),
              "model.layers.0.self_attn.q_norm.weight": (32,), "lm_head.weight": (33, 64)}
    assert all(m is None for m in row_maps(QWEN3.architecture.state_dict_adapter(shape, None).from_hf, shapes).values())


def test_an_adapter_that_moves_columns_is_refused() -> None:
    def transposing(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"w.weight": hf["w.weight"].t()}

    with pytest.raises(ValueError, match="more than a reordering of its rows"):
        row_maps(transposing, {"w.weight": (8, 8)})


@pytest.mark.parametrize("name", [Q, K])
def test_every_row_window_read_through_the_map_is_the_adapters_output_cut(tmp_path: Path, name: str) -> None:
    adapter = LLAMA3.architecture.state_dict_adapter(LLAMA, None)
    hf = {n: torch.randn(s) for n, s in _llama_shapes().items()}
    save_file(hf, str(tmp_path / "model.safetensors"))
    titan = adapter.from_hf(dict(hf))
    titan_name = name.replace("model.layers.0.self_attn.", "layers.0.attention.qkv_linear.").replace("q_proj", "wq")
    titan_name = titan_name.replace("k_proj", "wk")
    rows = row_maps(adapter.from_hf, _llama_shapes())[titan_name.replace(".0.", ".{}.")]
    reader = SliceReader(dict.fromkeys(hf, tmp_path / "model.safetensors"))
    n = hf[name].shape[0]
    for a in range(n + 1):
        for b in range(a, n + 1):
            got = reader.read_rows(name, (slice(a, b), slice(8, 40)), rows)
            assert torch.equal(got, titan[titan_name][a:b, 8:40]), (a, b)
