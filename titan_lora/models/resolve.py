"""`[model]` resolved: the family, the model's shape, the HF directory; what cannot work is refused here.

With `load_pretrained = true` the model's shape comes from the directory's config.json (the family's
`shape_from_hf`) and `flavor` is not used; with `false`, `flavor` gives the shape of a random-init model.
Before any model is built this refuses a config.json of another family (naming the `[model] name` that
loads it), a tokenizer whose ids do not fit the model's vocabulary (otherwise an IndexError in the first
forward), and a checkpoint that lacks or misshapes a weight.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch.nn as nn

from titan_lora.model_shape import DecoderShape
from titan_lora.models.checkpoint import has_tokenizer, read_hf_config, tied_embeddings, tokenizer_size
from titan_lora.models.family import ModelFamily, families_for_model_type, model_family
from titan_lora.models.load import check_weights
from titan_lora.titan.models import StateDictAdapter

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ResolvedModel:
    """What `[model]` selects, checked: `meta_model` builds it (on the meta device)."""

    family: ModelFamily
    shape: DecoderShape
    hf_dir: str
    """The HF directory: tokenizer, config.json, and the weights when `load_pretrained`."""
    load_pretrained: bool

    @property
    def tied(self) -> bool:
        """The output head is the embedding (config.json's `tie_word_embeddings` when loading, else the
        flavor's): the engine then ties lm_head itself, so the base stream leaves it out."""
        return self.shape.tied

    def meta_model(self) -> nn.Module:
        """The model on the meta device (shapes only, no memory)."""
        return self.family.architecture.meta_model(self.shape)

    def name_mapper(self) -> StateDictAdapter:
        """The family's torchtitan <-> HF state-dict adapter for this shape, for names and shapes only (no HF
        save index)."""
        return self.family.architecture.state_dict_adapter(self.shape, None)


def _flavor_shape(family: ModelFamily, model_cfg) -> DecoderShape:  # noqa: ANN001
    if model_cfg.flavor not in family.flavors:
        raise ValueError(f"[model] flavor = {model_cfg.flavor!r} is unknown for {model_cfg.name!r}; "
                         f"choose one of {sorted(family.flavors)}, or set load_pretrained = true to take the "
                         "shape from [model] hf_assets_path's config.json")
    return family.flavors[model_cfg.flavor]


def _check_model_type(family: ModelFamily, name: str, config: dict[str, Any], hf_dir: str) -> None:
    model_type = config.get("model_type", "")
    if not family.model_types or model_type in family.model_types:
        return
    owners = families_for_model_type(model_type)
    fix = (f"set [model] name = {owners[0]!r}" if owners else
           "no registered family loads it: add one (docs/extending.md, `A model family`)")
    raise ValueError(f"[model] name = {name!r} loads {', '.join(family.model_types)} checkpoints, but "
                     f"{hf_dir}/config.json is model_type {model_type!r}; {fix}")


def _check_vocab(hf_dir: str, shape: DecoderShape, from_config: bool) -> None:
    if not has_tokenizer(hf_dir):
        return  # nothing to compare; a job that needs the tokenizer fails on loading it
    tokens, vocab = tokenizer_size(hf_dir), shape.vocab_size
    if tokens <= vocab:
        return
    fix = ("config.json's vocab_size is smaller than the tokenizer beside it: use the tokenizer that "
           "came with these weights" if from_config else
           f"choose a [model] flavor with vocab_size >= {tokens}, or set load_pretrained = true to take "
           "the shape from config.json")
    raise ValueError(f"the tokenizer in {hf_dir} has {tokens} tokens but the model's vocabulary holds "
                     f"{vocab} (ids >= {vocab} would fail in the first forward); {fix}")


def resolve_model(model_cfg) -> ResolvedModel:  # noqa: ANN001 (the [model] section)
    """The family, shape and HF directory `[model]` names; ValueError, naming the fix, for what cannot work."""
    family = model_family(model_cfg.name)
    if family.default_assets and model_cfg.hf_assets_path:
        raise ValueError(f"[model] name = {model_cfg.name!r} brings its own checkpoint, so hf_assets_path = "
                         f"{model_cfg.hf_assets_path!r} would be ignored; for that checkpoint use the "
                         f"family of its config.json (e.g. name = 'llama3'), or remove hf_assets_path")
    load = model_cfg.load_pretrained
    hf_dir = family.hf_dir(model_cfg.hf_assets_path, need_weights=load)
    config = read_hf_config(hf_dir) if load else {}
    from_config = load and family.shape_from_hf is not None
    if from_config:
        _check_model_type(family, model_cfg.name, config, hf_dir)
        shape = family.shape_from_hf(config)
        logger.info("[model] shape from %s/config.json ([model] flavor is not used)", hf_dir)
    else:
        shape = _flavor_shape(family, model_cfg)
        if load:  # a flavor's shape over a checkpoint: its head is tied as the checkpoint says
            shape = dataclasses.replace(shape, tied=tied_embeddings(config))
    _check_vocab(hf_dir, shape, from_config)
    resolved = ResolvedModel(family, shape, hf_dir, load)
    if load:
        check_weights(resolved.meta_model(), hf_dir, resolved.name_mapper(), resolved.tied)
    return resolved
