"""An HF checkpoint directory, read without building a model: config.json, weight files, tokenizer size.

Family-agnostic. Weights are one `*.safetensors` file or shards named by `model.safetensors.index.json`;
their names and shapes come from the safetensors headers, so a checkpoint is checked in milliseconds.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# safetensors header dtype -> torch dtype name
_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64",
           "I32": "int32", "U8": "uint8", "I8": "int8", "BOOL": "bool"}
NO_WEIGHTS_FIX = "point [model] hf_assets_path at a complete HF checkpoint, or set load_pretrained = false"


def read_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    """The directory's config.json; ValueError naming the fix when there is none."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"[model] load_pretrained = true needs an HF checkpoint, but {hf_dir} has no "
                         f"config.json; {NO_WEIGHTS_FIX}")
    return json.loads(path.read_text())


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings in transformers 5's `rope_parameters` form, also from older `rope_theta`/`rope_scaling`."""
    if config.get("rope_parameters"):
        return dict(config["rope_parameters"])
    scaling = dict(config.get("rope_scaling") or {})
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    return {**scaling, "rope_theta": config.get("rope_theta", 10000.0)}


def require(config: dict[str, Any], key: str, allowed: tuple[Any, ...], model: str) -> None:
    """Refuse a config.json whose `key` (absent: `allowed[0]`) is a setting `model` cannot run."""
    value = config.get(key, allowed[0])
    if value not in allowed:
        raise ValueError(f"config.json has {key} = {value!r}, which torchtitan's {model} cannot run "
                         f"(it supports {', '.join(map(repr, allowed))}); this checkpoint needs another family")


def tied_embeddings(config: dict[str, Any]) -> bool:
    """Whether the checkpoint stores one matrix for the embedding and the output head."""
    return bool(config.get("tie_word_embeddings", False))


def eos_id(config: dict[str, Any], default: int) -> int:
    """config.json's `eos_token_id` (the first of a list), else `default` (also for an id of 0)."""
    eos = config.get("eos_token_id")
    return (eos[0] if isinstance(eos, list) else eos) or default


def weight_files(hf_dir: str | Path) -> dict[str, Path]:
    """Weight name -> the safetensors file holding it (index and shards, or single files)."""
    root = Path(hf_dir)
    index = root / INDEX
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        absent = sorted({f for f in weight_map.values() if not (root / f).is_file()})
        if absent:
            raise ValueError(f"{index} names {len(absent)} shard(s) that are not in {hf_dir}: "
                             f"{', '.join(absent[:4])}; copy every shard of the checkpoint")
        return {name: root / f for name, f in weight_map.items()}
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {hf_dir}; {NO_WEIGHTS_FIX}")
    found: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            found.update(dict.fromkeys(st.keys(), f))
    return found


def weight_shapes(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every weight of the checkpoint as a meta tensor of its shape and dtype (headers only, no data)."""
    by_file: dict[Path, list[str]] = {}
    for name, f in weight_files(hf_dir).items():
        by_file.setdefault(f, []).append(name)
    out: dict[str, torch.Tensor] = {}
    for f, names in by_file.items():
        with safe_open(str(f), framework="pt") as st:
            present = set(st.keys())
            for name in names:
                if name not in present:
                    raise ValueError(f"{f} lacks {name!r}, which {INDEX} says it holds; re-download that shard")
                view = st.get_slice(name)
                dtype = getattr(torch, _DTYPES.get(view.get_dtype(), "float32"))
                out[name] = torch.empty(view.get_shape(), dtype=dtype, device="meta")
    return out


def read_hf_state_dict(hf_dir: str | Path, tied: bool) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint (every shard), with `lm_head.weight` = the embedding where `tied`."""
    state: dict[str, torch.Tensor] = {}
    for f in sorted(set(weight_files(hf_dir).values())):
        state.update(load_file(str(f)))
    if tied and "lm_head.weight" not in state:  # tied embeddings are saved once
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def has_tokenizer(hf_dir: str | Path) -> bool:
    """Whether the directory holds a tokenizer (vLLM and the trainer read it from there)."""
    return any((Path(hf_dir) / f).is_file() for f in TOKENIZER_FILES)


@functools.lru_cache(maxsize=8)
def tokenizer_size(hf_dir: str) -> int:
    """The number of token ids the directory's tokenizer can produce (added tokens included)."""
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(hf_dir))
