"""torchtitan 0.3.0's model architectures, built from a neutral `DecoderShape`: the model's config tree and
the model on the meta device, the state-dict adapter that maps its weights to and from HF names, its own
flavors as shapes.

Part of the seam (`titan_lora.titan`): the families above it describe models as `DecoderShape`s and never see
torchtitan's configs. 0.3.0 builds a model from a `Module.Config` tree; model converters (LoRA) rewrite the
tree before the build (`ModelConfigConverter`), and TP is declared on the configs (`update_from_config`
fills every sub-config's `sharding_config` from `[parallelism]`), so an architecture has no TP plan of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import spmd_types as spmd
import torch
import torch.nn as nn
from torchtitan.models.common.decoder_sharding import dense_activation_placement
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from titan_lora.model_shape import DecoderShape
from titan_lora.titan.decoder import shape_of_config

__all__ = ["OUTPUT_HEAD", "Architecture", "ConfigConverter", "StateDictAdapter", "architecture", "output_head"]

OUTPUT_HEAD = "lm_head"
"""The attribute that holds a torchtitan decoder's output head (0.2.2 called it `output`)."""

ConfigConverter = Callable[[Any], Any]
"""A model converter: an unbuilt config tree in, the (rewritten) tree out."""


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One torchtitan decoder: shapes in, its config tree, model and state-dict adapter out."""

    name: str
    to_config: Callable[[DecoderShape], Any]
    """A shape as this architecture's config tree (ValueError for a shape it cannot build)."""
    state_dict_adapter_cls: type[StateDictAdapter]
    flavors: Mapping[str, DecoderShape]
    """torchtitan's own flavors of it (those titan_lora can run), as shapes."""
    titan_flavors: Mapping[str, Callable[[], Any]]
    """torchtitan's own flavor factories (its config trees, as it builds them), by flavor name."""
    hf_weight_map: Callable[[], dict[str, str | None]]
    """HF weight name -> torchtitan's (`{}` for the layer), from torchtitan's own state-dict adapter."""

    def model_config(self, shape: DecoderShape, job_config: Any = None,
                     converters: Sequence[ConfigConverter] = ()) -> Any:
        """The config tree for `shape`, its RoPE sized to `[training] seq_len` when a job config is given (as
        0.2.2's `update_from_config` did), rewritten by `converters` in order."""
        if job_config is not None:
            shape = dataclasses.replace(shape, max_seq_len=job_config.training.seq_len)
        config = self.to_config(shape)
        for convert in converters:
            config = convert(config)
        return config

    def meta_model(self, shape: DecoderShape, job_config: Any = None,
                   converters: Sequence[ConfigConverter] = (), parallelism: Any = None) -> nn.Module:
        """The model for `shape` on the meta device (shapes only, no memory); with `parallelism` (0.3.0's
        `ParallelismConfig`) its sub-configs get their sharding first."""
        config = self.model_config(shape, job_config, converters)
        return build_meta(config, parallelism)

    def state_dict_adapter(self, shape: DecoderShape, hf_dir: str | None) -> StateDictAdapter:
        """torchtitan's <-> HF state-dict adapter for `shape` (`hf_dir` None: no HF save index)."""
        return self.state_dict_adapter_cls(self.to_config(shape), hf_dir)


FLAVOR_ATTENTION = "flex"
"""The attention torchtitan's own flavor factories are called with (they refuse sdpa): only their shapes are
read; titan_lora builds every shape with SDPA (`decoder_config`)."""


def architecture(name: str, to_config: Callable[[DecoderShape], Any], adapter_cls: type[StateDictAdapter],
                 titan_configs: Mapping[str, Callable[..., Any]],
                 include: Callable[[str], bool] = lambda flavor: True) -> Architecture:
    """The `Architecture` of a torchtitan family: its flavors are the entries of its config registry
    (`titan_configs`, flavor -> factory) that `include` keeps, read as shapes; its HF names are those its own
    state-dict adapter maps."""
    factories = {flavor: partial(make, attn_backend=FLAVOR_ATTENTION) for flavor, make in titan_configs.items()
                 if include(flavor)}

    def hf_weight_map() -> dict[str, str | None]:
        return dict(adapter_cls(titan_configs["debugmodel"](attn_backend=FLAVOR_ATTENTION), None).from_hf_map)

    return Architecture(name, to_config, adapter_cls,
                        flavors={flavor: shape_of_config(make()) for flavor, make in factories.items()},
                        titan_flavors=factories, hf_weight_map=hf_weight_map)


@dataclasses.dataclass
class _ConfigView:
    """What `Decoder.Config.update_from_config` reads from a non-Trainer caller (decoder.py:111-135)."""

    parallelism: Any


def build_meta(config: Any, parallelism: Any = None) -> nn.Module:
    """Build a config tree on the meta device (sharding filled from `parallelism` first, when given)."""
    if parallelism is not None:
        config.update_from_config(config=_ConfigView(parallelism))
        replicated_logits(config)
    with torch.device("meta"):
        model = config.build()
    model.verify_module_protocol()
    return model


def replicated_logits(config: Any) -> None:
    """Under TP, the head's output all-gathered to whole-vocabulary logits (0.3.0 leaves them vocab-sharded,
    decoder_sharding.py:330-336): titan_lora's losses read whole rows (`[parallelism] disable_loss_parallel`'s
    meaning in 0.2.2)."""
    sharding = getattr(config.lm_head, "sharding_config", None)
    if sharding is not None:
        config.lm_head.sharding_config = dataclasses.replace(
            sharding, out_dst_shardings=dense_activation_placement(tp=spmd.R))


def output_head(model: nn.Module) -> nn.Module | None:
    """The model's output head (vocab projection), or None for a model that has none by that name."""
    head = getattr(model, OUTPUT_HEAD, None)
    return head if isinstance(head, nn.Module) else None
