"""Adapter tensors in torchtitan naming -> PEFT naming, and PEFT directories on disk.

torchtitan's Llama uses interleaved RoPE and HF uses rotate-half, so the state-dict adapter permutes
the rows of wq/wk. The adapter's output rows live in lora_B, so lora_B of wq/wk gets the same
permutation; lora_A (input side) is unchanged. Module names come from the state-dict adapter's own
map, so trainer, PEFT and engines agree on them.
"""

from __future__ import annotations

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
from torchtitan.models.llama3.model.state_dict_adapter import Llama3StateDictAdapter

from titan_lora.config import LoRA

PEFT_PREFIX = "base_model.model."


def hf_rope_permute(rows: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder output rows from interleaved RoPE (torchtitan) to rotate-half (HF), per head."""
    out_dim, in_dim = rows.shape
    return rows.view(n_heads, out_dim // n_heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def titan_rope_permute(rows: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of `hf_rope_permute`: rotate-half (HF) rows back to interleaved (torchtitan)."""
    out_dim, in_dim = rows.shape
    return rows.view(n_heads, 2, out_dim // n_heads // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _hf_module_names(sd_adapter: Llama3StateDictAdapter) -> dict[str, str]:
    # "layers.{}.attention.wq" -> "model.layers.{}.self_attn.q_proj", from the adapter's own map.
    return {
        titan.removesuffix(".weight"): hf.removesuffix(".weight")
        for hf, titan in sd_adapter.from_hf_map.items()
        if titan is not None and titan.endswith(".weight")
    }


def peft_name_and_heads(name: str, sd_adapter: Llama3StateDictAdapter) -> tuple[str, int | None]:
    """PEFT name of adapter tensor `name`, and the head count whose RoPE permutation its rows need.

    `layers.0.attention.wq.lora_B` -> (`base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight`,
    n_heads); lora_A, and projections other than wq/wk, need no permutation (None).
    """
    names = _hf_module_names(sd_adapter)
    args = sd_adapter.model_args
    heads = {"attention.wq": args.n_heads, "attention.wk": args.n_kv_heads or args.n_heads}
    module, suffix = name.rsplit(".", 1)
    abstract = re.sub(r"\d+", "{}", module, count=1)
    layer = re.search(r"\d+", module)
    hf_module = names[abstract].format(layer.group(0) if layer else "")
    n_heads = heads.get(abstract.removeprefix("layers.{}.")) if suffix == "lora_B" else None
    return f"{PEFT_PREFIX}{hf_module}.{suffix}.weight", n_heads


def to_peft_names(
    adapter: Mapping[str, torch.Tensor], sd_adapter: Llama3StateDictAdapter
) -> dict[str, torch.Tensor]:
    """Map {`layers.0.attention.wq.lora_B`: t} to {`base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight`: t'}.

    t' is t with the RoPE row permutation for wq/wk lora_B. The order of `adapter` is kept.
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in adapter.items():
        peft_name, n_heads = peft_name_and_heads(name, sd_adapter)
        out[peft_name] = tensor if n_heads is None else hf_rope_permute(tensor, n_heads)
    return out


def peft_config(cfg: LoRA, hf_target_modules: list[str], base_model_path: str = "") -> dict[str, Any]:
    """The `adapter_config.json` contents that PEFT, vLLM and SGLang read."""
    return {
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
