"""Adapter tensors in torchtitan naming -> PEFT naming, and PEFT directories on disk.

Family-agnostic: a `PeftLayout` (built by the model family) says which HF module each torchtitan module
is and which modules' output rows torchtitan keeps in interleaved RoPE order. HF uses rotate-half, so
the state-dict adapter permutes those rows of the base weight; the adapter's output rows live in
lora_B, so lora_B gets the same permutation, and lora_A (input side) is unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from titan_lora.config import LoRA

PEFT_PREFIX = "base_model.model."


@dataclasses.dataclass(frozen=True)
class RopeRows:
    """Output rows that torchtitan keeps in interleaved RoPE order: `n_heads` heads of `head_dim` rows."""

    n_heads: int
    head_dim: int


@dataclasses.dataclass(frozen=True)
class PeftLayout:
    """Where one model's adapter tensors go in PEFT naming, and which lora_B rows are RoPE-permuted.

    Keys are torchtitan module names with `{}` for the layer index (`layers.{}.attention.qkv_linear.wq`).
    """

    hf_modules: Mapping[str, str]
    """torchtitan module -> HF module: `layers.{}.attention.qkv_linear.wq` -> `model.layers.{}.self_attn.q_proj`."""
    rope: Mapping[str, RopeRows]
    """The modules whose lora_B rows need the RoPE permutation, with their heads."""


def hf_module_names(from_hf_map: Mapping[str, str | None]) -> dict[str, str]:
    """torchtitan module -> HF module, from a state-dict adapter's `from_hf_map` of weight names."""
    return {
        titan.removesuffix(".weight"): hf.removesuffix(".weight")
        for hf, titan in from_hf_map.items()
        if titan is not None and titan.endswith(".weight")
    }


def _check_rows(rows: torch.Tensor, rope: RopeRows) -> None:
    if rows.shape[0] != rope.n_heads * rope.head_dim or rope.head_dim % 2:
        raise ValueError(f"cannot RoPE-permute {rows.shape[0]} rows as {rope.n_heads} heads of "
                         f"{rope.head_dim}; the family's RopeRows do not match this projection")


def hf_rope_permute(rows: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Reorder output rows from interleaved RoPE (torchtitan) to rotate-half (HF), per head."""
    _check_rows(rows, RopeRows(n_heads, head_dim))
    return rows.view(n_heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(rows.shape)


def titan_rope_permute(rows: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """The inverse of `hf_rope_permute`: rotate-half (HF) rows back to interleaved (torchtitan)."""
    return TitanRopeOrder(RopeRows(n_heads, head_dim)).strided(rows).reshape(rows.shape)


@dataclasses.dataclass(frozen=True)
class TitanRopeOrder:
    """How the gather lays a RoPE lora_B into its output (`sync.gather.Layout`): HF rows, read in
    torchtitan's order. Called on positions it permutes them; `strided` gives the same order as a view,
    which the CPU gather copies into without an index."""

    rope: RopeRows

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        """`titan_rope_permute` of `rows`."""
        return self.strided(rows).reshape(rows.shape)

    def strided(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows` (HF order) as a view whose elements, read in order, are torchtitan's order."""
        _check_rows(rows, self.rope)
        return rows.view(self.rope.n_heads, 2, self.rope.head_dim // 2, -1).transpose(1, 2)


EXPERT_ADAPTER = re.compile(r"lora_([AB])_(gate_up_proj|down_proj)")
"""A routed experts module's adapter param (`LoRAExperts`): stacked (experts, r, in) / (experts, out, r)."""
# PEFT nests its ParamWrappers in sorted target order: gate_up_proj's is the inner one (`experts.base_layer`).
_EXPERT_WRAPPER = {"gate_up_proj": "base_layer.", "down_proj": ""}
EXPERT_TARGET_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
"""The `target_parameters` of PEFT's adapter config for adapted experts (HF's fused expert parameters)."""


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """One stacked expert adapter param in PEFT 0.21's layout for HF's fused expert parameters
    (`ParamWrapper`): A's rows blocked per expert ((experts * r, in): a plain reshape), B's columns
    interleaved ((out, r * experts), column j * experts + e being expert e's j-th: PEFT views B as (out, r,
    experts), peft/tuners/lora/layer.py `get_delta_factors`)."""

    is_a: bool
    shape: tuple[int, int, int]
    """The trainer's stacked shape."""

    @property
    def peft_shape(self) -> tuple[int, int]:
        experts, rows, cols = self.shape
        return (experts * rows, cols) if self.is_a else (rows, cols * experts)

    def to_peft(self, stacked: torch.Tensor) -> torch.Tensor:
        """The stacked tensor in PEFT's layout."""
        return stacked.reshape(self.peft_shape) if self.is_a else stacked.permute(1, 2, 0).reshape(self.peft_shape)

    def to_trainer(self, peft: torch.Tensor) -> torch.Tensor:
        """A tensor in PEFT's layout back in the trainer's stacked one (for positions: where each goes)."""
        _, rows, cols = self.shape
        return peft.reshape(self.shape) if self.is_a else peft.reshape(rows, cols, -1).permute(2, 0, 1)


def expert_layout(name: str, shape: tuple[int, ...]) -> ExpertLayout | None:
    """The PEFT layout of a stacked expert adapter param `name` of `shape`; None for any other param."""
    match = EXPERT_ADAPTER.fullmatch(name.rsplit(".", 1)[-1])
    return None if match is None else ExpertLayout(match.group(1) == "A", tuple(shape))  # type: ignore[arg-type]


def peft_name_and_rope(name: str, layout: PeftLayout) -> tuple[str, RopeRows | None]:
    """PEFT name of adapter tensor `name`, and the RoPE rows its permutation needs (None: no permutation).

    `layers.0.attention.qkv_linear.wq.lora_B` ->
    (`base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight`, RopeRows(n_heads, head_dim)) for Llama;
    lora_A, and modules outside `layout.rope`, get None.
    """
    module, suffix = name.rsplit(".", 1)
    expert = EXPERT_ADAPTER.fullmatch(suffix)
    if expert is not None:  # `...mlp.experts.base_layer.lora_A.weight`: PEFT's wrapper of gate_up_proj
        wrapper = _EXPERT_WRAPPER[expert.group(2)]
        return f"{PEFT_PREFIX}{hf_module_name(module, layout.hf_modules)}.{wrapper}lora_{expert.group(1)}.weight", None
    rope = layout.rope.get(re.sub(r"\d+", "{}", module, count=1)) if suffix == "lora_B" else None
    return f"{PEFT_PREFIX}{hf_module_name(module, layout.hf_modules)}.{suffix}.weight", rope


def hf_module_name(module: str, hf_modules: Mapping[str, str]) -> str:
    """The HF module of torchtitan module `module` (`layers.0.attention.qkv_linear.wq` ->
    `model.layers.0.self_attn.q_proj`); KeyError when `hf_modules` has no such module."""
    layer = re.search(r"\d+", module)
    return hf_modules[re.sub(r"\d+", "{}", module, count=1)].format(layer.group(0) if layer else "")


def to_peft_names(adapter: Mapping[str, torch.Tensor], layout: PeftLayout) -> dict[str, torch.Tensor]:
    """Map {`layers.0.attention.qkv_linear.wq.lora_B`: t} to
    {`base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight`: t'}.

    t' is t with the RoPE row permutation where the layout asks for it. The order of `adapter` is kept.
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in adapter.items():
        peft_name, rope = peft_name_and_rope(name, layout)
        expert = expert_layout(name, tuple(tensor.shape))
        if expert is not None:
            tensor = expert.to_peft(tensor)
        out[peft_name] = tensor if rope is None else hf_rope_permute(tensor, rope.n_heads, rope.head_dim)
    return out


def peft_config(cfg: LoRA, hf_target_modules: list[str], base_model_path: str = "",
                experts: bool = False) -> dict[str, Any]:
    """The `adapter_config.json` contents that PEFT, vLLM and SGLang read (`experts`: routed experts adapted,
    as PEFT's `target_parameters`)."""
    return {
        **({"target_parameters": EXPERT_TARGET_PARAMETERS} if experts else {}),
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_path,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "use_rslora": cfg.use_rslora,
        "lora_dropout": cfg.dropout,
        "target_modules": hf_target_modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
    }


def check_finite(tensors: Mapping[str, torch.Tensor]) -> None:
    """Raise ValueError naming the first tensor that holds NaN or Inf."""
    for name, tensor in tensors.items():
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"refusing to export a non-finite adapter: {name} holds NaN/Inf")


def _sibling(out: Path, kind: str) -> Path:
    """A new empty directory beside `out` (same filesystem, so renames are atomic; usual permissions)."""
    path = out.parent / f".{out.name}.{kind}-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    return path


def replace_dir(new: Path, out: Path) -> None:
    """Move directory `new` to `out`, replacing what is there: old aside, new in place, old removed."""
    old = None
    if out.exists():
        old = _sibling(out, "old")
        os.rename(out, old / out.name)
    try:
        os.rename(new, out)
    except OSError:
        if old is not None:
            os.rename(old / out.name, out)  # put the previous export back
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_peft_dir(
    path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]
) -> Path:
    """Write `adapter_config.json` + `adapter_model.safetensors` (the layout PEFT and vLLM load), atomically.

    The files go to a temporary directory beside `path` that is renamed into place only once complete,
    so a reader (or a crash) never sees a half-written or non-finite export.
    """
    out = Path(path)
    cpu = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    check_finite(cpu)  # on the host copies: no device synchronisation per tensor
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(out, "tmp")
    try:
        save_file(cpu, str(tmp / "adapter_model.safetensors"))
        (tmp / "adapter_config.json").write_text(json.dumps(dict(config), indent=2))
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
