"""Load an HF safetensors checkpoint into a (sharded) torchtitan model through its state-dict adapter."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from titan_lora.lora.layer import clean_fqn, is_adapter_param


def read_hf_state_dict(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF checkpoint directory, with the tied `lm_head.weight` filled in."""
    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {hf_dir}; is it an HF checkpoint directory?")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    if "lm_head.weight" not in state:  # tied embeddings are saved once
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


@torch.no_grad()
def load_base_weights(model: nn.Module, hf_dir: str | Path, sd_adapter: StateDictAdapter) -> None:
    """Copy the base weights into `model` (any sharding); adapters are left as initialised."""
    titan_state = sd_adapter.from_hf(read_hf_state_dict(hf_dir))
    expected = {clean_fqn(n) for n, _ in model.named_parameters() if not is_adapter_param(n)}
    missing = sorted(expected - set(titan_state))
    if missing:
        raise ValueError(f"checkpoint {hf_dir} lacks {len(missing)} base weights, e.g. {missing[:3]}")
    # full_state_dict: every rank holds the full tensors and keeps its own shard, no broadcast.
    set_model_state_dict(
        model, titan_state, options=StateDictOptions(full_state_dict=True, strict=False)
    )
