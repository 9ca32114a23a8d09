"""K adapters built through torchtitan's config tree (`[[adapters]]` on the "lora" converter): each adapter is
on exactly the linears it targets, at its own rank and scale, initialised as a one-adapter build with its keys
initialises its `lora_A` / `lora_B`; under TP=2 each adapter's parameters follow their base's plan as
`lora_A` / `lora_B` do."""

from __future__ import annotations

import torch
from dist_helpers import run_ranks
from model_helpers import COLWISE, DEBUG_LORA, TP2, full_copy

from titan_lora.config_adapters import Adapter
from titan_lora.lora.layer import LoRALayer, adapter_params, is_adapter_param, lora_scale
from titan_lora.lora.multi import MultiLoRALayer
from titan_lora.lora.multi_rows import group_rows, routed
from titan_lora.trainer.build import build_model
from titan_lora.trainer.distributed import device_for_rank, init_distributed
from titan_lora.trainer.job_config import job_from_toml
from titan_lora.titan.parallel import build_parallel_dims

ADAPTERS = [Adapter(name="attn", rank=4, alpha=8, target_modules=["q_proj", "v_proj"]),
            Adapter(name="mlp", rank=8, alpha=4, target_modules=["gate_proj", "down_proj", "q_proj"])]


def build(*overrides: str, adapters: list[Adapter] | None = None, **lora: object):
    """The debug SmolLM2 on this process group, with `adapters` (several: K-adapter linears) or `lora`'s keys
    set on [lora] (one adapter)."""
    cfg, resolved = job_from_toml(DEBUG_LORA, *overrides)
    for key, value in lora.items():
        setattr(cfg.lora, key, value)
    cfg.adapters = list(adapters or [])
    device = device_for_rank()
    init_distributed(device)
    dims = build_parallel_dims(cfg.parallelism, torch.distributed.get_world_size(), device)
    return build_model(cfg, dims, device, resolved).model


def modules_of(model: torch.nn.Module, kind: type) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, kind)}


def test_each_adapter_is_on_its_targets_at_its_rank_and_initialised_and_computes_as_alone() -> None:
    multi_model = build(adapters=ADAPTERS)
    multi = modules_of(multi_model, MultiLoRALayer)
    assert multi, "no K-adapter linear was built"
    init = {n: p.detach().clone() for n, p in multi_model.named_parameters()}
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # trained-looking adapters: B non-zero
        for _, param in adapter_params(multi_model):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    tokens = torch.randint(0, 49152, (4, 12), generator=generator)
    order, rows = group_rows([1, 0, 1, 0], len(ADAPTERS))
    with torch.no_grad(), routed(multi_model, rows):
        mixed = multi_model(tokens[order])
    for k, adapter in enumerate(ADAPTERS):
        alone_model = build(rank=adapter.rank, alpha=adapter.alpha, target_modules=adapter.target_modules)
        alone = modules_of(alone_model, LoRALayer)
        with torch.no_grad():  # the debug model's random base: the same as the multi-adapter model's
            for name, param in alone_model.named_parameters():
                if name in init and not is_adapter_param(name):
                    param.copy_(init[name])
        on = {name for name, m in multi.items() if k in m.adapter_scales}
        assert on == set(alone), f"adapter {adapter.name} is on {sorted(on ^ set(alone))} differently"
        for name, single in alone.items():
            m = multi[name]
            a, b = init[f"{name}.lora_A_{k}"], init[f"{name}.lora_B_{k}"]
            assert a.shape == single.lora_A.shape == (adapter.rank, m.in_features), name
            assert torch.equal(a, single.lora_A), f"{name}: adapter {k}'s A differs from its one-adapter build"
            assert torch.equal(b, single.lora_B) and not b.any(), name
            assert m.adapter_scales[k] == single.scale == lora_scale(adapter.rank, adapter.alpha, False)
            with torch.no_grad():
                single.lora_A.copy_(getattr(m, f"lora_A_{k}"))
                single.lora_B.copy_(getattr(m, f"lora_B_{k}"))
        start, end = rows.bounds(k)
        with torch.no_grad():
            own = alone_model(tokens[order][start:end])
        diff = (mixed[start:end] - own).abs().max().item()
        assert diff <= 1e-5, f"adapter {adapter.name}'s rows differ from the model alone by {diff:.2e}"
    both = [name for name, m in multi.items() if len(m.adapter_scales) == 2]
    assert both and all(name.endswith("wq") for name in both), both  # q_proj: the one linear both target
    trainable = {n for n, p in multi_model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in adapter_params(multi_model)}, "only the adapters train"


def _tp_ranks(rank: int, world: int, out: str) -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    model = build(*TP2, adapters=ADAPTERS)
    for name, m in modules_of(model, MultiLoRALayer).items():
        leaf = name.rsplit(".", 1)[-1]
        want = (Replicate(), Shard(0)) if leaf in COLWISE else (Shard(1), Replicate())
        for k in m.adapter_scales:
            a, b = getattr(m, f"lora_A_{k}"), getattr(m, f"lora_B_{k}")
            assert isinstance(a, DTensor) and isinstance(b, DTensor), name
            assert (a.placements[-1], b.placements[-1]) == want, (name, k, a.placements, b.placements)
    full = {n: full_copy(p) for n, p in adapter_params(model)}
    if rank == 0:
        torch.save(full, out)
    torch.distributed.barrier()


def test_under_tp2_each_adapter_follows_its_bases_plan_with_the_one_rank_values(tmp_path) -> None:
    reference = {n: p.detach().clone() for n, p in adapter_params(build(adapters=ADAPTERS))}
    run_ranks(2, _tp_ranks, str(tmp_path / "tp.pt"))
    tp = torch.load(tmp_path / "tp.pt")
    assert list(tp) == list(reference)
    for name, value in reference.items():
        assert torch.equal(tp[name], value), f"{name} initialised differently under TP"
