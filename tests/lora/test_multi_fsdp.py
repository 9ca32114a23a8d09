"""K adapters under FSDP2 on 2 gloo ranks: each rank trains its own rows (one rank has none of an adapter),
and the adapters end as one process training the whole batch does (which test_multi.py proves equal to each
adapter trained alone)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from dist_helpers import run_ranks
from multi_helpers import adapter_param_groups, init_adapters, params_by_adapter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from titan_lora.lora.layer import adapter_params, freeze_base
from titan_lora.lora.multi import AdapterShape, add_adapters
from titan_lora.lora.multi_optim import clip_per_adapter
from titan_lora.lora.multi_rows import group_rows, routed

VOCAB, DIM, STEPS, MAX_NORM = 64, 32, 6, 0.05
SHAPES = {  # linear -> each adapter's (rank, scale), None where it does not target the linear
    "wq": ((4, 2.0), (8, 0.5), None), "wo": ((4, 2.0), None, (2, 8.0)),
    "w1": ((4, 2.0), None, (2, 8.0)), "w2": ((4, 2.0), (8, 0.5), None),
}
LRS = (1e-2, 3e-3, 2e-2)
ROW_ADAPTER = [0, 1, 2, 0, 0, 0, 1, 0]  # rows r::2 go to rank r: rank 1 gets no row of adapter 2
TOKENS = torch.randint(0, VOCAB, (len(ROW_ADAPTER), 12), generator=torch.Generator().manual_seed(0))


class Block(nn.Module):
    """A decoder-like block: positions mix within a row (a causal running mean), never across rows."""

    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wo = nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.w1, self.w2 = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(1, x.shape[1] + 1, dtype=x.dtype).view(1, -1, 1)
        x = x + self.wo(self.wq(x).cumsum(1) / steps)
        return x + self.w2(F.silu(self.w1(x)))


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block(), Block()])
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for block in self.layers:
            x = block(x)
        return self.lm_head(x)


def multi_toy() -> nn.Module:
    torch.manual_seed(0)
    model = Toy()
    for block in model.layers:
        for name, shapes in SHAPES.items():
            add_adapters(getattr(block, name), [AdapterShape(*s) if s else None for s in shapes])
    init_adapters(model, [11, 12, 13])
    freeze_base(model)
    return model


def train(model: nn.Module, tokens: torch.Tensor, row_adapter: list[int], totals: list[int]) -> None:
    """STEPS steps on this rank's rows; adapter k's loss: summed token loss over its global token count."""
    opt = torch.optim.AdamW(adapter_param_groups(params_by_adapter(model, 3), LRS), weight_decay=0.01)
    order, rows = group_rows(row_adapter, 3)
    tokens = tokens[order]
    for _ in range(STEPS):
        opt.zero_grad()
        with routed(model, rows):
            logits = model(tokens)[:, :-1]
            loss = logits.sum() * 0
            for k in range(3):
                start, end = rows.bounds(k)
                seg = logits[start:end]
                loss = loss + F.cross_entropy(seg.reshape(-1, VOCAB), tokens[start:end, 1:].reshape(-1),
                                              reduction="sum") / totals[k]
            loss.backward()
        clip_per_adapter(opt.param_groups, MAX_NORM)
        opt.step()


def _fsdp_matches_one_process(rank: int, world: int) -> None:
    totals = [ROW_ADAPTER.count(k) * (TOKENS.shape[1] - 1) for k in range(3)]
    reference = multi_toy()
    train(reference, TOKENS, ROW_ADAPTER, totals)
    model = multi_toy()
    mesh = init_device_mesh("cpu", (world,))
    for module in (*model.layers, model):
        fully_shard(module, mesh=mesh)
        module.set_gradient_divide_factor(1.0)  # the loss is already divided by the global token counts
        module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    mine = list(range(rank, len(ROW_ADAPTER), world))
    train(model, TOKENS[mine], [ROW_ADAPTER[i] for i in mine], totals)
    want = dict(adapter_params(reference))
    for name, param in adapter_params(model):
        got = param.full_tensor()
        assert float((got - want[name]).abs().max()) <= 1e-6, name
        assert float(got.abs().max()) > 0, name
    assert float(dict(adapter_params(model))["layers.0.wo.lora_B_2"].full_tensor().abs().max()) > 1e-3


def test_k_adapters_under_fsdp_on_two_ranks_match_one_process() -> None:
    run_ranks(2, _fsdp_matches_one_process)

