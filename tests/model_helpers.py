"""Build small titan_lora models inside test ranks from TOML text."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from dist_helpers import rank_device

from titan_lora.lora.layer import LoRALayer, adapter_params, is_adapter_param, lora_class, lora_modules
from titan_lora.titan.lora_linear import fill_param
from titan_lora.trainer.build import BuiltModel, build_from_toml
from titan_lora.trainer.job_config import job_config_from_toml


def lora_toml(model: str, rank: int = 8, alpha: int = 16) -> str:
    """A LoRA job (all linears, fp32, seq_len 64) whose `[model]` section holds the `model` lines."""
    return f"""
[model]
{model}
converters = ["lora"]
[lora]
rank = {rank}
alpha = {alpha}
target_modules = "all-linear"
[training]
seq_len = 64
mixed_precision_param = "float32"
[activation_checkpoint]
mode = "none"
"""


SMOLLM2_LORA = lora_toml('name = "smollm2"\nflavor = "135M"\nload_pretrained = true')
DEBUG_LORA = SMOLLM2_LORA.replace('flavor = "135M"', 'flavor = "debug"').replace(
    "load_pretrained = true", "load_pretrained = false"
)
SFT_SECTIONS = """
[optimizer]
name = "AdamW"
lr = 1e-3
weight_decay = 0.0
[lr_scheduler]
warmup_steps = 2
"""
"""An SFT job's optimizer and schedule: AdamW at 1e-3, two warmup steps."""
DEBUG_SFT = DEBUG_LORA + SFT_SECTIONS
"""An SFT job on the debug SmolLM2."""
ONE_STEP_SECTIONS = """
[optimizer]
name = "AdamW"
lr = 1e-3
weight_decay = 0.0
[lr_scheduler]
warmup_steps = 0
[checkpoint]
enable = false
"""
"""A one-step comparison's optimizer: AdamW at 1e-3 from the first step (no warmup), no checkpoint."""


TP2 = ("--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1",
       "--parallelism.disable_loss_parallel")
"""Overrides for TP=2 alone (2 ranks)."""
TP2_FSDP2 = ("--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=2",
             "--parallelism.disable_loss_parallel")
"""Overrides for TP=2 x FSDP=2 (4 ranks)."""
COLWISE = {"wq", "wk", "wv", "w1", "w3"}
ROWWISE = {"wo", "w2"}


def check_tp2_placements(model: torch.nn.Module) -> None:
    """Under TP=2, alone or x FSDP=2, every adapter follows its base's plan on the tp dim: colwise (B sharded
    on its output rows, A replicated) or rowwise (A sharded on its input columns, B replicated), on all seven
    linears; with FSDP-sharded adapters, dim 0 is also sharded on the fsdp dim. Only adapters train."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    seen = set()
    for name, module in lora_modules(model):
        leaf = name.rsplit(".", 1)[-1]
        seen.add(leaf)
        w, a, b = module.weight, module.lora_A, module.lora_B
        assert all(isinstance(t, DTensor) for t in (w, a, b)), name
        dims, base_dims = a.device_mesh.mesh_dim_names, w.device_mesh.mesh_dim_names
        # Replicated adapters (the default) sit on the TP mesh alone, outside FSDP; sharded ones on the base's
        assert dims in (("tp",), ("fsdp", "tp")) and b.device_mesh.mesh_dim_names == dims, (name, dims)
        assert base_dims in (("tp",), ("fsdp", "tp")), (name, base_dims)
        assert dims in (base_dims, ("tp",)), (name, dims, base_dims)
        tp, fsdp = dims.index("tp"), 2 if "fsdp" in dims else 1
        want = (Shard(0), Replicate(), Shard(0)) if leaf in COLWISE else (Shard(1), Shard(1), Replicate())
        got = (w.placements[base_dims.index("tp")], a.placements[tp], b.placements[tp])
        assert got == want, (name, w.placements, a.placements, b.placements)
        if fsdp > 1:  # FSDP shards dim 0 (plain or strided, when TP already split dim 0)
            for t in (a, b):
                assert getattr(t.placements[0], "dim", None) == 0, f"{name}: fsdp placement {t.placements}"
        assert a.to_local().numel() * (2 if leaf in ROWWISE else 1) * fsdp == a.numel(), name
        assert b.to_local().numel() * (2 if leaf in COLWISE else 1) * fsdp == b.numel(), name
    assert seen == COLWISE | ROWWISE
    # TP styles re-register the params they shard as new nn.Parameters (requires_grad=True): the base must
    # come out of parallelization frozen again, or LoRA + TP trains the whole model.
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter_param(n) for n in trainable), sorted(trainable - {
        n for n in trainable if is_adapter_param(n)})[:5]
    assert all(p.requires_grad for _, m in lora_modules(model) for p in (m.lora_A, m.lora_B))


def job_config_from(toml: str, *overrides: str):
    """Parse TOML text (plus CLI-style overrides) into the merged JobConfig."""
    return job_config_from_toml(toml, *overrides)


def build_from(toml: str, *overrides: str) -> BuiltModel:
    """Build the model of `toml` on this rank's device (its GPU under NCCL, else the CPU), sharded over
    the current process group."""
    return build_from_toml(toml, *overrides, device=rank_device())


@torch.no_grad()
def randomize_adapters(model: torch.nn.Module, seed: int = 1, std: float = 0.05) -> None:
    """Give every adapter a non-zero, seeded B (and A), identical for any sharding (LoRA experts too)."""
    for i, (_, m) in enumerate(lora_modules(model)):
        g = torch.Generator().manual_seed(seed * 7919 + i)
        for name, p in m.named_parameters(recurse=False):
            if is_adapter_param(name):
                fill_param(p, torch.randn(p.shape, generator=g) * std)


class StubSdAdapter:
    """A state-dict adapter stand-in: renames by a table (None: no HF weight) and doubles the values."""

    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "lm_head.weight": "lm_head.weight", "freqs_cis": None}

    def __init__(self) -> None:
        self.seen: list[tuple[str, torch.device, tuple[int, ...]]] = []

    def to_hf(self, state: dict) -> dict:
        out = {}
        for name, t in state.items():
            self.seen.append((name, t.device, tuple(t.shape)))
            if self.names[name] is not None:
                out[self.names[name]] = t * 2
        return out


class StubBaseModel(torch.nn.Module):
    """A few base weights (one without an HF name) and two adapter params, for the base stream."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Module()
        self.a.lora_B = torch.nn.Parameter(torch.ones(2, 1))  # an adapter param first: skipped, not the end
        self.tok_embeddings = torch.nn.Embedding(4, 2)
        self.norm = torch.nn.LayerNorm(2, bias=False)
        self.lm_head = torch.nn.Linear(2, 4, bias=False)
        self.freqs_cis = torch.nn.Parameter(torch.ones(3))
        self.q = torch.nn.Module()
        self.q.lora_A = torch.nn.Parameter(torch.ones(1, 2))  # an adapter param: never part of the base


def full_copy(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of the whole tensor on the CPU (collective for a DTensor: every rank must call it)."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def full_adapter(named) -> dict[str, torch.Tensor]:
    """`full_copy` of every (name, param) pair, e.g. of `adapter_params(model)` (collective)."""
    return {n: full_copy(p) for n, p in named}


LoRALinear = lora_class(nn.Linear)
"""The LoRA subclass of a plain `nn.Linear`, for tests of the LoRA mixin outside a torchtitan model."""


def convert_linear(linear: nn.Linear, rank: int, scale: float, dropout: float, dtype: torch.dtype) -> LoRALayer:
    """Turn a plain `linear` into its class's LoRA subclass in place (same object, same `.weight`/`.bias`), as
    titan_lora did on torchtitan 0.2.2's built models: the LoRA mixin's tests run on it."""
    device = linear.weight.device
    linear.__class__ = lora_class(type(linear))
    linear.lora_A = nn.Parameter(torch.empty(rank, linear.in_features, device=device, dtype=dtype))
    linear.lora_B = nn.Parameter(torch.empty(linear.out_features, rank, device=device, dtype=dtype))
    linear.scale = scale
    linear.lora_dropout_p = dropout
    return linear  # type: ignore[return-value]


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int = 0) -> None:
    """The adapter init titan_lora has always given, as a reference: kaiming-uniform A drawn whole from a generator
    seeded by (seed, the module's index in module order), zero B; the same for any number of ranks."""
    for index, (_, module) in enumerate(lora_modules(model)):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
        full_a = torch.empty(module.lora_A.shape, dtype=torch.float32)
        bound = 1.0 / math.sqrt(module.in_features)  # kaiming_uniform_ with a=sqrt(5)
        full_a.uniform_(-bound, bound, generator=gen)
        fill_param(module.lora_A, full_a.to(module.lora_A.dtype))
        fill_param(module.lora_B, torch.zeros(module.lora_B.shape, dtype=module.lora_B.dtype))


def train_and_save(run, rank: int, out: str) -> None:
    """Collective: run `run.train()`, then rank 0 saves every adapter param in full and each step's metrics to
    `out` ({"weights": {name: tensor}, "metrics": [per-step dict]})."""
    logged = []
    real_step = run.train_step
    run.train_step = lambda: logged.append(real_step()) or logged[-1]
    run.train()
    weights = {n: full_copy(p) for n, p in adapter_params(run.model)}
    if rank == 0:
        torch.save({"weights": weights, "metrics": logged}, out)


def weights_by_adapter(weights: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """A K-adapter model's adapter weights per adapter index, each under the name its one-adapter job gives it
    (`...wq.lora_A_1` -> adapter 1's `...wq.lora_A`)."""
    from titan_lora.lora.multi import adapter_of, one_adapter_name

    out: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in weights.items():
        out.setdefault(adapter_of(name), {})[one_adapter_name(name)] = value
    return out
