"""LoRALinear: still an nn.Linear, exact at step 0, scaled as configured, only adapters trainable."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from dist_helpers import run_ranks
from model_helpers import DEBUG_LORA, LoRALinear, build_from, convert_linear, full_copy, randomize_adapters
from torch.distributed.tensor import DTensor

from titan_lora.lora.layer import (
    LoRALayer,
    adapter_params,
    adapters_disabled,
    clean_fqn,
    freeze_base,
    is_adapter_param,
    lora_class,
    lora_modules,
    lora_scale,
)

TOKENS = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0))



# ---------------------------------------------------------------- the layer itself


def test_convert_keeps_the_same_linear_weight_and_bias() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(5, 3, bias=True)
    weight, bias = linear.weight, linear.bias
    lora = convert_linear(linear, rank=2, scale=0.5, dropout=0.1, dtype=torch.float32)
    assert lora is linear, "converted in place, so every reference to the module stays valid"
    assert isinstance(lora, LoRALinear) and isinstance(lora, nn.Linear)
    assert lora.weight is weight and lora.bias is bias
    assert (lora.in_features, lora.out_features) == (5, 3)
    assert lora.lora_A.shape == (2, 5) and lora.lora_B.shape == (3, 2)
    assert set(dict(lora.named_parameters())) == {"weight", "bias", "lora_A", "lora_B"}
    assert lora.lora_dropout_p == 0.1
    assert list(lora.children()) == [], "TP styles read .weight of every child of a linear"


class _FrameworkLinear(nn.Linear):
    """A framework's own linear (as torchtitan 0.3.0's `Linear`): its own forward and its own methods."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 100.0

    def framework_protocol(self) -> str:
        return "kept"


def test_convert_subclasses_the_linears_own_class_and_runs_its_forward() -> None:
    torch.manual_seed(0)
    linear = _FrameworkLinear(6, 4)
    lora = convert_linear(linear, rank=2, scale=0.5, dropout=0.0, dtype=torch.float32)
    # The framework's protocol checks and initialisers see their own class; LoRA is found by its mixin.
    assert isinstance(lora, _FrameworkLinear) and isinstance(lora, LoRALayer)
    assert lora.framework_protocol() == "kept"
    assert type(lora) is lora_class(_FrameworkLinear) is lora_class(type(lora)), "one LoRA class per base class"
    assert type(lora) is not LoRALinear
    with torch.no_grad():
        lora.lora_A.normal_()
        lora.lora_B.normal_()
    x = torch.randn(3, 6)
    expected = F.linear(x, lora.weight, lora.bias) + 100.0 + 0.5 * (x @ lora.lora_A.T @ lora.lora_B.T)
    torch.testing.assert_close(lora(x), expected)
    model = nn.Sequential(nn.Linear(6, 6), lora)
    assert [name for name, _ in lora_modules(model)] == ["1"]


def test_convert_creates_adapters_on_the_linears_device_with_the_configured_dtype() -> None:
    meta = nn.Linear(5, 3, device="meta")
    convert_linear(meta, rank=2, scale=1.0, dropout=0.0, dtype=torch.bfloat16)
    # torchtitan converts on the meta device and materialises later: the adapter must follow the weight.
    assert meta.lora_A.is_meta and meta.lora_B.is_meta
    assert meta.lora_A.dtype == meta.lora_B.dtype == torch.bfloat16
    assert meta.weight.dtype == torch.float32, "the base keeps its own dtype"


def test_forward_is_base_plus_scaled_low_rank_update() -> None:
    torch.manual_seed(0)
    linear = convert_linear(nn.Linear(6, 4, bias=True), rank=3, scale=0.75, dropout=0.0, dtype=torch.float32)
    with torch.no_grad():
        linear.lora_A.normal_()
        linear.lora_B.normal_()
    x = torch.randn(2, 7, 6)
    expected = x @ linear.weight.T + linear.bias + 0.75 * (x @ linear.lora_A.T @ linear.lora_B.T)
    torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        linear.lora_B.zero_()
    assert torch.equal(linear(x), F.linear(x, linear.weight, linear.bias)), "B = 0 must be the base, exactly"


def _identity_adapter(dim: int, p: float, base_scale: float, scale: float) -> LoRALinear:
    """W = base_scale * I, b = 0, A = B = I: the output is base_scale * x + scale * dropout(x)."""
    linear = convert_linear(nn.Linear(dim, dim), rank=dim, scale=scale, dropout=p, dtype=torch.float32)
    with torch.no_grad():
        linear.weight.copy_(base_scale * torch.eye(dim))
        linear.bias.zero_()
        linear.lora_A.copy_(torch.eye(dim))
        linear.lora_B.copy_(torch.eye(dim))
    return linear


def test_dropout_equals_a_hand_built_mask_on_the_adapter_input_only() -> None:
    torch.manual_seed(0)
    p, scale = 0.3, 0.75
    linear = convert_linear(nn.Linear(8, 6), rank=4, scale=scale, dropout=p, dtype=torch.float32)
    with torch.no_grad():
        linear.lora_A.normal_()
        linear.lora_B.normal_()
    x = torch.randn(5, 8)
    torch.manual_seed(123)
    out = linear.train()(x)
    torch.manual_seed(123)  # the same draw by hand: keep with probability 1 - p, scale kept values by 1/(1-p)
    keep = torch.empty_like(x).bernoulli_(1 - p)
    dropped = x * keep / (1 - p)
    expected = x @ linear.weight.T + linear.bias + scale * (dropped @ linear.lora_A.T @ linear.lora_B.T)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert 0 < int(keep.sum()) < keep.numel(), "the seed must both keep and drop, or this proves nothing"


def test_dropout_is_off_in_eval() -> None:
    torch.manual_seed(0)
    linear = _identity_adapter(16, p=0.5, base_scale=2.0, scale=0.5).eval()
    x = torch.randn(4, 16)
    assert torch.equal(linear(x), 2.0 * x + 0.5 * x)


def test_dropout_rate_and_rescaling_and_the_base_path_is_untouched() -> None:
    torch.manual_seed(0)
    p = 0.3
    linear = _identity_adapter(64, p=p, base_scale=2.0, scale=1.0).train()
    x = torch.rand(2000, 64) + 0.5  # no zeros of its own
    with torch.no_grad():
        adapter_part = linear(x) - 2.0 * x  # the base path must be exactly 2x, never dropped
    kept = adapter_part.abs() > 1e-6
    torch.testing.assert_close(adapter_part[kept], x[kept] / (1 - p), rtol=1e-5, atol=1e-5)
    assert torch.all(adapter_part[~kept].abs() <= 1e-6)
    rate = 1 - kept.float().mean().item()
    assert abs(rate - p) < 0.01, f"dropped {rate:.4f} of the adapter inputs, configured {p}"


@pytest.mark.parametrize(
    ("rank", "alpha", "rslora", "expected"),
    [(8, 16, False, 2.0), (16, 16, False, 1.0), (16, 8, True, 2.0), (4, 4, True, 2.0), (1, 3, True, 3.0)],
)
def test_lora_scale(rank: int, alpha: float, rslora: bool, expected: float) -> None:
    assert lora_scale(rank, alpha, rslora) == pytest.approx(expected)


def test_is_adapter_param() -> None:
    assert is_adapter_param("layers.0.attention.wq.lora_A")
    assert is_adapter_param("layers.0.attention.wq.lora_B")
    assert is_adapter_param("lora_A"), "a bare LoRALinear's own parameters"
    assert not is_adapter_param("layers.0.attention.wq.weight")
    assert not is_adapter_param("layers.0.attention.lora_A_norm.weight")
    # Adapter k of a multi-adapter linear (lora.multi): trainable, never loaded or streamed as base.
    assert is_adapter_param("layers.0.attention.wq.lora_B_2")
    assert not is_adapter_param("layers.0.attention.wq.lora_A_x")


def test_adapters_disabled_runs_the_base_and_restores_every_scale() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    for layer, scale in zip(model, (0.5, 3.0)):
        convert_linear(layer, 2, scale, 0.0, torch.float32)
        with torch.no_grad():
            layer.lora_A.normal_()
            layer.lora_B.normal_()
    x = torch.randn(3, 4)
    base = F.linear(F.linear(x, model[0].weight, model[0].bias), model[1].weight, model[1].bias)
    with adapters_disabled(model):
        assert torch.equal(model(x), base)
    assert [m.scale for m in model] == [0.5, 3.0]
    with pytest.raises(RuntimeError, match="boom"), adapters_disabled(model):
        raise RuntimeError("boom")
    assert [m.scale for m in model] == [0.5, 3.0], "restored even when the body raises"
    assert not torch.equal(model(x), base)


def test_clean_fqn_drops_wrapper_segments() -> None:
    name = "layers.0._checkpoint_wrapped_module.attention.qkv_linear.wq.lora_A"
    assert clean_fqn(name) == "layers.0.attention.qkv_linear.wq.lora_A"
    assert clean_fqn("layers.0.attention.wq") == "layers.0.attention.wq"


def test_freeze_base_leaves_only_adapters_trainable() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    convert_linear(model[0], 2, 1.0, 0.0, torch.float32)
    freeze_base(model)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == ["0.lora_A", "0.lora_B"]


# ---------------------------------------------------------------- on the built model


def test_built_model_scale_follows_the_config() -> None:
    plain = build_from(DEBUG_LORA)  # rank 8, alpha 16
    rs = build_from(DEBUG_LORA.replace("alpha = 16", "alpha = 8\nuse_rslora = true"))
    assert {m.scale for _, m in lora_modules(plain.model)} == {2.0}
    assert [m.scale for _, m in lora_modules(rs.model)] == pytest.approx([8 / 8**0.5] * 14)
    # The scale is what the forward applies: a non-zero adapter moves the output by scale * x A^T B^T.
    randomize_adapters(rs.model)
    wq = rs.model.layers["0"].attention.qkv_linear.wq
    x = torch.randn(3, wq.in_features)
    with torch.no_grad():
        delta = wq(x) - F.linear(x, wq.weight)
    torch.testing.assert_close(delta, (8 / 8**0.5) * (x @ wq.lora_A.T @ wq.lora_B.T), rtol=1e-5, atol=1e-6)


def test_step_zero_equals_the_base_model() -> None:
    torch.manual_seed(0)
    base = build_from(DEBUG_LORA.replace('converters = ["lora"]', "converters = []")).model
    torch.manual_seed(0)
    built = build_from(DEBUG_LORA)
    lora = built.model
    assert not any(isinstance(m, LoRALayer) for m in base.modules())
    assert len(list(lora_modules(lora))) == 14

    # Same base weights (the converter does not disturb the base init) ...
    base_sd = {k: v for k, v in base.state_dict().items()}
    for name, value in lora.state_dict().items():
        if not is_adapter_param(name):
            assert torch.equal(value, base_sd[name]), name
    # ... kaiming A, zero B ...
    for name, module in lora_modules(lora):
        assert torch.count_nonzero(module.lora_B) == 0, name
        bound = 1 / module.in_features**0.5
        assert module.lora_A.abs().max() <= bound and module.lora_A.std() > bound / 4, name
    # ... so the outputs are the base's, bit for bit.
    with torch.no_grad():
        assert torch.equal(lora(TOKENS), base(TOKENS))
        randomize_adapters(lora)
        moved = (lora(TOKENS) - base(TOKENS)).abs().max().item()
    assert moved > 1e-2, "a non-zero adapter must change the logits, or the check above proves nothing"


def test_only_adapters_require_and_receive_grad() -> None:
    built = build_from(DEBUG_LORA)
    model = built.model
    randomize_adapters(model)  # B != 0, so A gets a gradient too
    for name, p in model.named_parameters():
        assert p.requires_grad == is_adapter_param(name), name
    model(TOKENS).float().logsumexp(-1).mean().backward()
    for name, p in model.named_parameters():
        if is_adapter_param(name):
            assert p.grad is not None and p.grad.abs().sum() > 0, f"{name} got no gradient"
        else:
            assert p.grad is None, f"a gradient reached the base weight {name}"
    n_adapter = sum(p.numel() for _, p in adapter_params(model))
    # debug flavor, rank 8, 2 layers: wq/wo 64x64, wk/wv 32x64, w1/w3 192x64, w2 64x192
    per_layer = 8 * ((64 + 64) * 2 + (64 + 32) * 2 + (64 + 192) * 3)
    assert n_adapter == 2 * per_layer


def _init_on_ranks(rank: int, world: int, out: str, *adapters: str) -> None:
    built = build_from(DEBUG_LORA, *adapters)
    full = {n: full_copy(p) for n, p in adapter_params(built.model)}  # collective, same order on every rank
    sharded = [isinstance(p, DTensor) for _, p in adapter_params(built.model)]
    assert all(sharded) if adapters else not any(sharded), "FSDP shards them iff replicate_adapters = false"
    torch.save(full, f"{out}.{rank}")


@pytest.mark.parametrize("adapters", [(), ("--lora.no_replicate_adapters",)],
                         ids=["replicated", "fsdp-sharded"])
def test_init_is_identical_for_one_and_two_ranks(tmp_path, adapters: tuple[str, ...]) -> None:
    run_ranks(2, _init_on_ranks, str(tmp_path / "two.pt"), *adapters)
    one = {n: full_copy(p) for n, p in adapter_params(build_from(DEBUG_LORA).model)}
    for rank in (0, 1):  # replicated: each rank's own copy; sharded: the shards put together
        two = torch.load(tmp_path / f"two.pt.{rank}")
        assert list(one) == list(two)
        for name in one:
            assert torch.equal(one[name], two[name]), f"{name} initialised differently on rank {rank} of 2"
    assert any(torch.count_nonzero(t) for n, t in one.items() if n.endswith("lora_A"))
