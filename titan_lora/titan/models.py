"""torchtitan's model protocols: the train spec a family builds on, and the state-dict adapter that maps
its weights to and from HF names.

Part of the seam (`titan_lora.titan`): 0.3.0 replaces `TrainSpec` with one `ModelSpec` per flavor and builds
models from config trees.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from torchtitan.protocols.state_dict_adapter import StateDictAdapter
from torchtitan.protocols.train_spec import TrainSpec

__all__ = ["StateDictAdapter", "TrainSpec", "family_train_spec"]


def family_train_spec(base: TrainSpec, flavors: Mapping[str, Any],
                      parallelize_fn: Callable[..., Any]) -> TrainSpec:
    """torchtitan's `base` spec with `flavors` and `parallelize_fn`, and no pipelining."""
    return dataclasses.replace(base, model_args=dict(flavors), pipelining_fn=None,
                               parallelize_fn=parallelize_fn)
