"""titan_lora's LoRA on torchtitan 0.3.0 vs HF + peft, on CPU in fp32: logits and adapter gradients."""

from __future__ import annotations

import pytest

from tests.titan03.helpers import require_torchtitan_03

require_torchtitan_03()

import torch  # noqa: E402

from tests.titan03.helpers import HF_TO_TITAN, TARGETS, row_permute, tiny_hf  # noqa: E402


def build_pair(family: str, rank: int = 4, alpha: float = 8.0):
    import peft
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    from titan_lora.lora.layer import freeze_base
    from titan_lora.titan03.lora import LoRASettings, build_lora_model_config
    from titan_lora.titan03.model import build_model_config, shape_from_hf

    hf = tiny_hf(family)
    hf_state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    shape = shape_from_hf(hf.config, family, max_seq_len=256)
    config = build_lora_model_config(
        build_model_config(shape), LoRASettings(rank=rank, alpha=alpha, target_modules="all-linear")
    )
    adapter_cls = Llama3StateDictAdapter if family == "llama3" else Qwen3StateDictAdapter
    titan_state = adapter_cls(config, None).from_hf(hf_state)
    with torch.device("meta"):
        model = config.build()
    model.verify_module_protocol()
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
    """The converter's param_init gives titan_lora's init_adapters values (kaiming-uniform A, zero B)."""
    from titan_lora.lora.layer import adapter_params, init_adapters
    from titan_lora.titan03.lora import LoRASettings, build_lora_model_config
    from titan_lora.titan03.model import ModelShape, build_model_config

    shape = ModelShape(family="llama3", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                       ffn_hidden_dim=64, vocab_size=100, norm_eps=1e-5, rope_theta=1e4)
    config = build_lora_model_config(build_model_config(shape), LoRASettings(rank=2), seed=7)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    got = {n: p.detach().clone() for n, p in adapter_params(model)}
    assert len(got) == 28 and all(torch.count_nonzero(v) == 0 for n, v in got.items() if n.endswith("lora_B"))
    init_adapters(model, seed=7)
    assert all(torch.equal(got[n], p) for n, p in adapter_params(model))


def test_targets_by_leaf_name_never_the_head() -> None:
    from titan_lora.lora.layer import lora_modules
    from titan_lora.titan03.lora import LoRASettings, build_lora_model_config
    from titan_lora.titan03.model import ModelShape, build_model_config

    shape = ModelShape(family="qwen3", dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16,
                       ffn_hidden_dim=64, vocab_size=100, norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
                       tie_embeddings=True)
    model = build_lora_model_config(build_model_config(shape), LoRASettings(target_modules=["k_proj", "w2"])).build()
    assert [n for n, _ in lora_modules(model)] == ["layers.0.attention.qkv_linear.wk", "layers.0.feed_forward.w2"]
    model = build_lora_model_config(build_model_config(shape), LoRASettings()).build()
    names = [n for n, _ in lora_modules(model)]
    assert len(names) == 7 and not any("lm_head" in n for n in names)
    with pytest.raises(ValueError, match="match no linear"):
        build_lora_model_config(build_model_config(shape), LoRASettings(target_modules=["wqkv"]))
