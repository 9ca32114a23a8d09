"""torchtitan's model architectures, built from a neutral `DecoderShape`: the model on the meta device, the
state-dict adapter that maps its weights to and from HF names, its TP plan, its own flavors as shapes.

Part of the seam (`titan_lora.titan`): the families above it describe models as `DecoderShape`s and never
see torchtitan's model args, so 0.3.0's config trees (one `ModelSpec` per flavor, q/k/v fused by default,
TP declared on configs) change `to_args` and the builders here, not the families.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.protocols.state_dict_adapter import StateDictAdapter
from torchtitan.protocols.train_spec import TrainSpec

from titan_lora.model_shape import DecoderShape
from titan_lora.titan.configs import titan_job_config

__all__ = ["OUTPUT_HEAD", "Architecture", "StateDictAdapter", "TensorParallel", "output_head"]

OUTPUT_HEAD = "output"
"""The attribute that holds a torchtitan decoder's output head (0.3.0 renames it `lm_head`)."""

TensorParallel = Callable[[nn.Module, DeviceMesh, Any], None]
"""An architecture's TP plan: `(model, tp_mesh, job_config)`, applied in place to the meta-device model."""


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One torchtitan decoder: shapes in, its model, state-dict adapter and TP plan out."""

    name: str
    train_spec: Callable[[], TrainSpec]
    """torchtitan's spec factory (model class, state-dict adapter class)."""
    to_args: Callable[[DecoderShape], Any]
    """A shape as this architecture's model args (ValueError for a shape it cannot build)."""
    tensor_parallel: TensorParallel
    """torchtitan's TP plan for it, `(model, tp_mesh, job_config)`, adapters left to the caller."""
    flavors: Mapping[str, DecoderShape]
    """torchtitan's own flavors of it (those titan_lora can run), as shapes."""
    hf_weight_map: Callable[[], dict[str, str | None]]
    """HF weight name -> torchtitan's (`{}` for the layer), from torchtitan's own state-dict adapter."""

    def model_args(self, shape: DecoderShape, job_config: Any = None) -> Any:  # noqa: ANN401
        """The model args for `shape`, updated from the job's config when one is given (`max_seq_len` from
        `[training] seq_len`, as torchtitan's Trainer does)."""
        args = self.to_args(shape)
        if job_config is not None:
            args.update_from_config(titan_job_config(job_config))
        return args

    def meta_model(self, shape: DecoderShape, job_config: Any = None) -> nn.Module:  # noqa: ANN401
        """The model for `shape` on the meta device (shapes only, no memory)."""
        args = self.model_args(shape, job_config)
        with torch.device("meta"):
            return self.train_spec().model_cls(args)

    def state_dict_adapter(self, shape: DecoderShape, hf_dir: str | None) -> StateDictAdapter:
        """torchtitan's <-> HF state-dict adapter for `shape` (`hf_dir` None: no HF save index)."""
        return self.train_spec().state_dict_adapter(self.to_args(shape), hf_dir)


def output_head(model: nn.Module) -> nn.Module | None:
    """The model's output head (vocab projection), or None for a model that has none by that name."""
    head = getattr(model, OUTPUT_HEAD, None)
    return head if isinstance(head, nn.Module) else None
