"""Load an HF safetensors checkpoint into a (sharded) torchtitan model through its state-dict adapter's names.

Each rank reads only the slices of its own shards (`titan_lora.models.slices`), tensor by tensor, so its
peak host memory is its share of the checkpoint, not the whole.

`check_weights` runs the same mapping on the checkpoint's headers against a meta-device model, so a
missing, unknown or misshapen weight is refused while the config is read, before any model is built.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

from titan_lora.lora.layer import clean_fqn, is_adapter_param
from titan_lora.models.checkpoint import NO_WEIGHTS_FIX, read_hf_state_dict, weight_files, weight_shapes
from titan_lora.models.row_maps import abstract_name, row_maps
from titan_lora.models.slices import SliceReader, local_box
from titan_lora.titan.models import OUTPUT_HEAD, StateDictAdapter


# torchtitan's stacked expert weights (`layers.3.moe.routed_experts.inner_experts.w1_EFD`): each expert's
# slice is its own HF tensor (`model.layers.3.mlp.experts.<e>.gate_proj.weight`).
_EXPERTS = re.compile(r".*\.inner_experts\.w[123]_E\w\w")


def _split_experts(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """`shapes` with each expert's HF tensor left out but expert 0's (the row maps probe one of each)."""
    return {n: s for n, s in shapes.items() if not re.search(r"\.experts\.[1-9]\d*\.", n)}


def _to_hf(sd_adapter: StateDictAdapter) -> dict[str, str]:
    """Abstract torchtitan weight name -> abstract HF name: the adapter's `from_hf_map` read backwards."""
    return {titan: hf for hf, titan in sd_adapter.from_hf_map.items() if titan is not None}


def _expert_names(to_hf: dict[str, str], name: str) -> str | None:
    """The HF name pattern (`{}` for the expert) of a stacked expert weight, None for any other weight."""
    if not _EXPERTS.fullmatch(name):
        return None
    layer = re.findall(r"\d+", name)[0]
    return to_hf[abstract_name(name)].replace("{}", layer, 1)


def _read_experts(reader: SliceReader, pattern: str, box: tuple[slice, ...]) -> torch.Tensor:
    """A stacked expert weight's box, read expert by expert (each its own HF tensor)."""
    parts = [reader.read(pattern.format(e), box[1:]) for e in range(box[0].start, box[0].stop)]
    if parts:
        return torch.stack(parts)
    return torch.empty(0, *(b.stop - b.start for b in box[1:]))


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


def _with_tied_head(hf: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """`hf` with `lm_head.weight` = the embedding where `tied` (tied embeddings are saved once)."""
    if tied and "lm_head.weight" not in hf and "model.embed_tokens.weight" in hf:
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    return hf


def _base_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    # named_parameters lists a tied output head once, under the embedding's name.
    return {clean_fqn(n): tuple(p.shape) for n, p in model.named_parameters() if not is_adapter_param(n)}


def check_weights(model: nn.Module, hf_dir: str | Path, sd_adapter: StateDictAdapter, tied: bool) -> None:
    """Refuse a checkpoint that lacks a base weight of `model` (meta device is enough) or misshapes one."""
    titan = sd_adapter.from_hf(_known(sd_adapter, _with_tied_head(weight_shapes(hf_dir), tied)))
    expected = _base_shapes(model)
    missing = sorted(set(expected) - set(titan))
    if missing:
        hint = (" (an untied output head: if the checkpoint ties it to the embedding, its config.json "
                "needs tie_word_embeddings = true)" if f"{OUTPUT_HEAD}.weight" in missing else "")
        raise ValueError(f"the checkpoint in {hf_dir} lacks {len(missing)} weights the model needs, e.g. "
                         f"{missing[:3]}{hint}; {NO_WEIGHTS_FIX}")
    wrong = [f"{n}: {tuple(titan[n].shape)} in the checkpoint, {shape} in the model"
             for n, shape in expected.items() if tuple(titan[n].shape) != shape]
    if wrong:
        raise ValueError(f"the checkpoint in {hf_dir} does not fit the model built from its config.json: "
                         f"{'; '.join(wrong[:3])}; check config.json against the weights")


def _hf_names(to_hf: dict[str, str], titan_names: list[str], hf_names: set[str], tied: bool) -> dict[str, str]:
    """torchtitan weight -> the HF weight it is read from (`to_hf`: `_to_hf` of the state-dict adapter)."""
    out = {}
    for name in titan_names:
        hf = to_hf.get(abstract_name(name))
        hf = hf.format(*re.findall(r"\d+", name)[:1]) if hf else None
        if tied and hf == "lm_head.weight" and hf not in hf_names:  # tied embeddings are saved once
            hf = "model.embed_tokens.weight"
        if hf in hf_names:
            out[name] = hf
    return out


@torch.no_grad()
def load_base_weights(model: nn.Module, hf_dir: str | Path, sd_adapter: StateDictAdapter,
                      tied: bool) -> SliceReader:
    """Copy the base weights into `model` (any sharding), each rank reading only its shards' slices;
    adapters stay as initialised. Returns the reader (its byte count)."""
    files = weight_files(hf_dir)
    shapes = {n: tuple(t.shape) for n, t in _with_tied_head(weight_shapes(hf_dir), tied).items()}
    params = {clean_fqn(n): p for n, p in model.named_parameters() if not is_adapter_param(n)}
    to_hf = _to_hf(sd_adapter)
    experts = {n: hf for n in params if (hf := _expert_names(to_hf, n)) is not None}
    maps = row_maps(lambda hf: sd_adapter.from_hf(_known(sd_adapter, hf)),
                    _split_experts(shapes) if experts else shapes)
    hf_names = _hf_names(to_hf, [n for n in params if n not in experts], set(files), tied)
    hf_names.update({n: hf.format(0) for n, hf in experts.items() if hf.format(0) in files})
    missing = sorted(set(params) - set(hf_names))
    if missing:
        raise ValueError(f"checkpoint {hf_dir} lacks {len(missing)} base weights, e.g. {missing[:3]}; "
                         f"{NO_WEIGHTS_FIX}")
    reader = SliceReader(files)
    for name, param in params.items():
        if name in experts:
            part = _read_experts(reader, experts[name], local_box(param))
        else:
            part = reader.read_rows(hf_names[name], local_box(param), maps.get(abstract_name(name)))
        # A DTensor's local tensor is a view of the sharded storage (FSDP2's padded one too): copied in place.
        local = param.to_local() if isinstance(param, DTensor) else param
        if part.shape != local.shape:  # copy_ would broadcast a misshapen slice silently
            raise ValueError(f"{hf_names[name]} in {hf_dir} gives a {tuple(part.shape)} slice for {name}'s "
                             f"{tuple(local.shape)} shard; check config.json against the weights")
        local.copy_(part)
        del part  # one slice in host memory at a time
    return reader


@torch.no_grad()
def load_base_weights_full(model: nn.Module, hf_dir: str | Path, sd_adapter: StateDictAdapter,
                           tied: bool) -> None:
    """The former load, every rank reading every tensor whole and keeping its shard: the reference that
    tests and scripts/bench_load.py hold `load_base_weights` to (the trainer never takes this path)."""
    titan_state = sd_adapter.from_hf(_known(sd_adapter, read_hf_state_dict(hf_dir, tied)))
    # full_state_dict: every rank holds the full tensors and keeps its own shard, no broadcast.
    set_model_state_dict(model, titan_state, options=StateDictOptions(full_state_dict=True, strict=False))
