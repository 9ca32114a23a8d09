"""Load an HF safetensors checkpoint into a (sharded) torchtitan model through its state-dict adapter.

`check_weights` runs the same mapping on the checkpoint's headers against a meta-device model, so a
missing, unknown or misshapen weight is refused while the config is read, before any model is built.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from titan_lora.lora.layer import clean_fqn, is_adapter_param
from titan_lora.models.checkpoint import NO_WEIGHTS_FIX, read_hf_state_dict, weight_shapes


def _known(sd_adapter: StateDictAdapter, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights the adapter maps (names it maps to None, e.g. rotary buffers, dropped); unknown: error."""
    table = sd_adapter.from_hf_map
    kept, unknown = {}, []
    for name, tensor in hf_state.items():
        abstract = next((a for a in (re.sub(r"\d+", "{}", name, count=n) for n in (1, 2)) if a in table), None)
        if abstract is None:
            unknown.append(name)
        elif table[abstract] is not None:
            kept[name] = tensor
    if unknown:
        raise ValueError(f"the checkpoint holds {len(unknown)} weights this model family has no place for, "
                         f"e.g. {unknown[:3]}; is [model] name the checkpoint's family (biases and MoE "
                         "experts are not supported)?")
    return kept


def _base_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    # named_parameters lists a tied output head once, under the embedding's name.
    return {clean_fqn(n): tuple(p.shape) for n, p in model.named_parameters() if not is_adapter_param(n)}


def check_weights(model: nn.Module, hf_dir: str | Path, sd_adapter: StateDictAdapter, tied: bool) -> None:
    """Refuse a checkpoint that lacks a base weight of `model` (meta device is enough) or misshapes one."""
    hf = weight_shapes(hf_dir)
    if tied and "lm_head.weight" not in hf and "model.embed_tokens.weight" in hf:
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    titan = sd_adapter.from_hf(_known(sd_adapter, hf))
    expected = _base_shapes(model)
    missing = sorted(set(expected) - set(titan))
    if missing:
        hint = (" (an untied output head: if the checkpoint ties it to the embedding, its config.json "
                "needs tie_word_embeddings = true)" if "output.weight" in missing else "")
        raise ValueError(f"the checkpoint in {hf_dir} lacks {len(missing)} weights the model needs, e.g. "
                         f"{missing[:3]}{hint}; {NO_WEIGHTS_FIX}")
    wrong = [f"{n}: {tuple(titan[n].shape)} in the checkpoint, {shape} in the model"
             for n, shape in expected.items() if tuple(titan[n].shape) != shape]
    if wrong:
        raise ValueError(f"the checkpoint in {hf_dir} does not fit the model built from its config.json: "
                         f"{'; '.join(wrong[:3])}; check config.json against the weights")


@torch.no_grad()
def load_base_weights(model: nn.Module, hf_dir: str | Path, sd_adapter: StateDictAdapter, tied: bool) -> None:
    """Copy the base weights into `model` (any sharding); adapters are left as initialised."""
    titan_state = sd_adapter.from_hf(_known(sd_adapter, read_hf_state_dict(hf_dir, tied)))
    missing = sorted(set(_base_shapes(model)) - set(titan_state))
    if missing:
        raise ValueError(f"checkpoint {hf_dir} lacks {len(missing)} base weights, e.g. {missing[:3]}")
    # full_state_dict: every rank holds the full tensors and keeps its own shard, no broadcast.
    set_model_state_dict(
        model, titan_state, options=StateDictOptions(full_state_dict=True, strict=False)
    )
