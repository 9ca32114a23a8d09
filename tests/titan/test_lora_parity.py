"""titan_lora's LoRA on torchtitan 0.3.0, through the seam and the families: the same logits and adapter
gradients as HF + peft (Llama 3 with llama3 RoPE scaling, Qwen3 with head_dim != dim / heads, q/k norms and a
tied head), adapters initialised as `init_adapters`, targets by leaf name (never the head). Moved from the
prototype's tests/titan03/test_parity.py."""

from __future__ import annotations

import pytest
import torch
from model_helpers import init_adapters

from titan_lora.config import LoRA
from titan_lora.lora.converter import lora_converter
from titan_lora.lora.layer import adapter_params, freeze_base, lora_modules
from titan_lora.model_shape import DecoderShape
from titan_lora.models.llama3 import LLAMA3
from titan_lora.models.qwen3 import QWEN3

FAMILIES = {"llama3": LLAMA3, "qwen3": QWEN3}

HF_TO_TITAN = {  # HF leaf module path (under model.layers.{i}.) -> 0.3.0 module path (under layers.{i}.)
    "self_attn.q_proj": "attention.qkv_linear.wq",
    "self_attn.k_proj": "attention.qkv_linear.wk",
    "self_attn.v_proj": "attention.qkv_linear.wv",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_hf(family: str):
    """A tiny random HF causal LM in fp32 (seeded)."""
    import torch
    import transformers

    torch.manual_seed(0)
    common = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=1000, max_position_embeddings=256,
    )
    if family == "llama3":
        cfg = transformers.LlamaConfig(
            **common, rms_norm_eps=1e-5, tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
            },
        )
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(
            **common, head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
        model = transformers.Qwen3ForCausalLM(cfg)
    model.config._attn_implementation = "eager"
    # Random norms too (HF inits them to ones), so a wrong norm mapping shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.float().eval()


def row_permute(family: str, titan_name: str, shape, n_heads: int, n_kv_heads: int):
    """A function mapping an HF-row-order tensor (rows = output features) to torchtitan's for this linear:
    Llama's q/k rows are reverse-permuted by 0.3.0's Llama3StateDictAdapter (ComplexRoPE, interleaved),
    so lora_B rows (and their grads) must be too; Qwen3 (CosSinRoPE) keeps HF's order."""
    leaf = titan_name.rsplit(".", 1)[-1]
    if family != "llama3" or leaf not in ("wq", "wk"):
        return lambda t: t
    heads = n_heads if leaf == "wq" else n_kv_heads

    def permute(t):
        out, cols = t.shape
        return t.view(heads, 2, out // heads // 2, cols).transpose(1, 2).reshape(out, cols)

    return permute


def build_pair(family: str, rank: int = 4, alpha: float = 8.0):
    import peft

    hf = tiny_hf(family)
    hf_state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    fam = FAMILIES[family]
    shape = fam.shape_from_hf(hf.config.to_dict())
    assert shape.max_seq_len == 256
    converter = lora_converter(LoRA(rank=rank, alpha=alpha, target_modules="all-linear"), fam.leaf_names)
    titan_state = fam.architecture.state_dict_adapter(shape, None).from_hf(hf_state)
    model = fam.architecture.meta_model(shape, converters=[converter])
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    missing, unexpected = model.load_state_dict(titan_state, strict=False)
    assert not unexpected
    assert all(k.endswith(("lora_A", "lora_B")) for k in missing), missing
    freeze_base(model)
    model.eval()

    lora_cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGETS, lora_dropout=0.0)
    peft_model = peft.get_peft_model(hf, lora_cfg).eval()

    # The same nonzero adapters in both; HF rows -> torchtitan rows where RoPE layouts differ.
    gen = torch.Generator().manual_seed(1)
    pairs = []  # (peft module, titan module, row map)
    for i in range(shape.n_layers):
        for hf_leaf, titan_leaf in HF_TO_TITAN.items():
            pm = peft_model.base_model.model.model.layers[i].get_submodule(hf_leaf)
            tm = model.get_submodule(f"layers.{i}.{titan_leaf}")
            a = torch.randn(pm.lora_A["default"].weight.shape, generator=gen) * 0.1
            b = torch.randn(pm.lora_B["default"].weight.shape, generator=gen) * 0.1
            perm = row_permute(family, titan_leaf, b.shape, shape.n_heads, shape.n_kv_heads)
            with torch.no_grad():
                pm.lora_A["default"].weight.copy_(a)
                pm.lora_B["default"].weight.copy_(b)
                tm.lora_A.copy_(a)
                tm.lora_B.copy_(perm(b))
            pairs.append((pm, tm, perm))
    return peft_model, model, pairs, shape


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_logits_and_adapter_grads_match_peft(family: str) -> None:
    peft_model, model, pairs, shape = build_pair(family)
    tokens = torch.randint(0, shape.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))

    hf_logits = peft_model(input_ids=tokens).logits
    titan_logits = model(tokens)  # tokens only: SDPA inner attention, causal, default positions
    logit_diff = (hf_logits - titan_logits).abs().max().item()

    target = torch.randn(hf_logits.shape, generator=torch.Generator().manual_seed(3))
    (hf_logits * target).sum().backward()
    (titan_logits * target).sum().backward()
    grad_diff = 0.0
    grad_scale = 0.0
    for pm, tm, perm in pairs:
        ga, gb = pm.lora_A["default"].weight.grad, pm.lora_B["default"].weight.grad
        grad_diff = max(grad_diff, (ga - tm.lora_A.grad).abs().max().item())
        grad_diff = max(grad_diff, (perm(gb) - tm.lora_B.grad).abs().max().item())
        grad_scale = max(grad_scale, ga.abs().max().item(), gb.abs().max().item())
    print(f"{family}: logits max|diff| {logit_diff:.3g} (|logits| max {hf_logits.abs().max():.3g}), "
          f"adapter grads max|diff| {grad_diff:.3g} (|grad| max {grad_scale:.3g})")
    assert logit_diff < 1e-4
    assert grad_diff < 1e-4 * max(1.0, grad_scale)
    # Only the adapters are trainable; every adapter got a gradient.
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 7 * shape.n_layers
    assert all(n.rsplit(".", 1)[-1] in ("lora_A", "lora_B") for n in trainable)


def test_adapter_init_is_titan_lora_init() -> None:
    """The converter's param_init gives titan_lora's init_adapters values (kaiming-uniform A, zero B), seeded by
    the module's index in the built model's order (the head last, though 0.3.0's config declares it first)."""
    shape = DecoderShape(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_hidden_dim=64,
                         vocab_size=100, norm_eps=1e-5, rope_theta=1e4)
    targets = ["wq", "wk", "wv", "wo", "w1", "w2", "w3", "lm_head"]
    converter = lora_converter(LoRA(rank=2, target_modules=targets), LLAMA3.leaf_names, seed=7)
    model = LLAMA3.architecture.meta_model(shape, converters=[converter])
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    got = {n: p.detach().clone() for n, p in adapter_params(model)}
    assert len(got) == 30 and all(torch.count_nonzero(v) == 0 for n, v in got.items() if n.endswith("lora_B"))
    assert list(got)[-2:] == ["lm_head.lora_A", "lm_head.lora_B"], list(got)[-4:]
    init_adapters(model, seed=7)
    assert all(torch.equal(got[n], p) for n, p in adapter_params(model))


def test_targets_by_leaf_name_never_the_head() -> None:
    shape = DecoderShape(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, ffn_hidden_dim=64,
                         vocab_size=100, norm_eps=1e-6, rope_theta=1e6, qk_norm=True, tied=True)

    def build(targets: list[str] | str) -> torch.nn.Module:
        converter = lora_converter(LoRA(target_modules=targets), QWEN3.leaf_names)
        return QWEN3.architecture.meta_model(shape, converters=[converter])

    model = build(["k_proj", "w2"])
    assert [n for n, _ in lora_modules(model)] == ["layers.0.attention.qkv_linear.wk", "layers.0.feed_forward.w2"]
    names = [n for n, _ in lora_modules(build("all-linear"))]
    assert len(names) == 7 and not any("lm_head" in n for n in names)
    with pytest.raises(ValueError, match="match no linear"):
        build(["wqkv"])
