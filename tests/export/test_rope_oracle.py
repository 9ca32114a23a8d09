"""An independent oracle for the RoPE row permutation of the PEFT export, under GQA, in the fast suite.

A tiny random HF LlamaForCausalLM (4 query heads, 2 KV heads) is the reference. Its weights reach a
torchtitan Llama3 through torchtitan's own `Llama3StateDictAdapter.from_hf`; the project's converter adds
LoRA with non-zero lora_B on every linear (wq and wk included); the project's export, and separately the
sync path's snapshot (`AdapterSource`), write a PEFT directory; peft loads it onto the HF model.
HF + peft and torchtitan must then give the same logits.
Neither side of the comparison is computed by the code under test's inverse.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from titan_lora.config import LoRA
from titan_lora.export.peft import peft_config, save_peft_dir, to_peft_names
from titan_lora.lora.converter import lora_converter
from titan_lora.lora.layer import adapter_params, is_adapter_param, lora_modules
from titan_lora.lora.targets import hf_leaf_names
from titan_lora.model_shape import DecoderShape
from titan_lora.models.llama3 import LLAMA3
from titan_lora.titan.models import StateDictAdapter
from titan_lora.sync.adapter_source import AdapterSource

# dim 64, 4 query heads and 2 KV heads of 16: GQA, so a permutation with the wrong head count differs.
ARGS = DecoderShape(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_hidden_dim=192, vocab_size=256,
                    norm_eps=1e-5, rope_theta=1e4, max_seq_len=64)
FFN_HIDDEN = ARGS.ffn_hidden_dim
TOKENS = torch.randint(0, ARGS.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))


def _hf_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=ARGS.vocab_size, hidden_size=ARGS.dim, intermediate_size=FFN_HIDDEN,
        num_hidden_layers=ARGS.n_layers, num_attention_heads=ARGS.n_heads,
        num_key_value_heads=ARGS.n_kv_heads,
        rms_norm_eps=ARGS.norm_eps, rope_theta=ARGS.rope_theta, max_position_embeddings=ARGS.max_seq_len,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # HF's init leaves norms at 1; random norms exercise the mapping more
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _titan_lora_model(
    hf_state: dict[str, torch.Tensor], lora: LoRA
) -> tuple[torch.nn.Module, StateDictAdapter]:
    sd_adapter = LLAMA3.architecture.state_dict_adapter(ARGS, None)
    model = LLAMA3.architecture.meta_model(ARGS, converters=[lora_converter(lora, LLAMA3.leaf_names)])
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    missing, unexpected = model.load_state_dict(sd_adapter.from_hf(hf_state), strict=False)
    assert not unexpected and all(is_adapter_param(k) for k in missing), (missing, unexpected)
    with torch.no_grad():
        for i, (_, m) in enumerate(lora_modules(model)):
            g = torch.Generator().manual_seed(100 + i)
            m.lora_A.copy_(torch.randn(m.lora_A.shape, generator=g) * 0.2)
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.2)
    return model.eval(), sd_adapter


def _export(titan: torch.nn.Module, sd_adapter: StateDictAdapter, lora: LoRA, path: Path) -> None:
    """The file export: to_peft_names + peft_config + save_peft_dir."""
    named = {n: p.detach() for n, p in adapter_params(titan)}
    assert any(n.endswith("attention.qkv_linear.wk.lora_B") for n in named), "the test needs an adapter on wk"
    targets = hf_leaf_names([n for n, _ in lora_modules(titan)], LLAMA3.leaf_names)
    save_peft_dir(path, to_peft_names(named, LLAMA3.peft_layout(ARGS)), peft_config(lora, targets))


def _sync_snapshot(
    titan: torch.nn.Module, sd_adapter: StateDictAdapter, lora: LoRA, path: Path
) -> None:
    """The hot path's snapshot (gather with the RoPE layout folded into its scatter), saved as PEFT."""
    AdapterSource(titan, LLAMA3.peft_layout(ARGS), lora).export(path)


@pytest.mark.parametrize("route", [_export, _sync_snapshot], ids=["export", "sync-snapshot"])
@pytest.mark.parametrize("lora", [LoRA(rank=4, alpha=8.0), LoRA(rank=4, alpha=2.0, use_rslora=True)],
                         ids=["plain", "rslora"])
def test_exported_adapter_on_hf_peft_matches_titan_under_gqa(
    tmp_path: Path, lora: LoRA, route: Callable
) -> None:
    from peft import PeftModel

    hf = _hf_model()
    hf_state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    titan, sd_adapter = _titan_lora_model(hf_state, lora)
    route(titan, sd_adapter, lora, tmp_path)

    with torch.no_grad():
        base_logits = hf(TOKENS).logits
        ours = titan(TOKENS)
        theirs = PeftModel.from_pretrained(hf, str(tmp_path)).eval()(TOKENS).logits
    effect = (theirs - base_logits).abs().max().item()
    diff = (ours.log_softmax(-1) - theirs.log_softmax(-1)).abs().max().item()
    assert effect > 0.5, f"the adapter moved the logits by only {effect:.3f}: this test would prove nothing"
    print(f"max |log_softmax titan - hf+peft| = {diff:.2e}; adapter effect {effect:.2f}")
    assert diff <= 2e-5, f"max |log_softmax titan - hf+peft| = {diff:.2e} (adapter effect {effect:.2f})"


def test_base_alone_matches_hf_so_any_gap_above_is_the_adapters() -> None:
    hf = _hf_model()
    titan, _ = _titan_lora_model(dict(hf.state_dict()), LoRA(rank=4, alpha=8.0))
    with torch.no_grad():
        for _, m in lora_modules(titan):
            m.lora_B.zero_()  # B = 0: the base model
        diff = (titan(TOKENS).log_softmax(-1) - hf(TOKENS).logits.log_softmax(-1)).abs().max().item()
    assert diff <= 2e-5
