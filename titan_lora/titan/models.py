"""torchtitan's model protocols: the train spec a family builds on (its flavors, its model on the meta
device), and the state-dict adapter that maps its weights to and from HF names.

Part of the seam (`titan_lora.titan`): 0.3.0 replaces `TrainSpec` with one `ModelSpec` per flavor and builds
models from config trees.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn
from torchtitan.protocols.state_dict_adapter import StateDictAdapter
from torchtitan.protocols.train_spec import TrainSpec

from titan_lora.titan.configs import titan_job_config

__all__ = ["OUTPUT_HEAD", "StateDictAdapter", "TrainSpec", "family_train_spec", "flavors", "job_model_args",
           "meta_model", "output_head", "state_dict_adapter"]

OUTPUT_HEAD = "output"
"""The attribute that holds a torchtitan decoder's output head (0.3.0 renames it `lm_head`)."""


def family_train_spec(base: TrainSpec, flavors: Mapping[str, Any],
                      parallelize_fn: Callable[..., Any]) -> TrainSpec:
    """torchtitan's `base` spec with `flavors` and `parallelize_fn`, and no pipelining."""
    return dataclasses.replace(base, model_args=dict(flavors), pipelining_fn=None,
                               parallelize_fn=parallelize_fn)


def flavors(spec: TrainSpec) -> Mapping[str, Any]:
    """The spec's flavors: name -> model args."""
    return spec.model_args


def job_model_args(args: Any, job_config) -> Any:  # noqa: ANN001, ANN401 (each family has its own args)
    """A copy of `args` updated from the job's config (`update_from_config`); `args` stay as they were."""
    args = dataclasses.replace(args)
    args.update_from_config(titan_job_config(job_config))
    return args


def meta_model(spec: TrainSpec, args: Any) -> nn.Module:  # noqa: ANN401
    """The spec's model for `args` on the meta device (shapes only, no memory)."""
    with torch.device("meta"):
        return spec.model_cls(args)


def state_dict_adapter(spec: TrainSpec, args: Any, hf_dir: str | None) -> StateDictAdapter:  # noqa: ANN401
    """The spec's torchtitan <-> HF state-dict adapter for `args` (`hf_dir` None: no HF save index)."""
    return spec.state_dict_adapter(args, hf_dir)


def output_head(model: nn.Module) -> nn.Module | None:
    """The model's output head (vocab projection), or None for a model that has none by that name."""
    head = getattr(model, OUTPUT_HEAD, None)
    return head if isinstance(head, nn.Module) else None
