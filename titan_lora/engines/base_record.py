"""What base this engine worker loaded: the digest of every checkpoint tensor as it went in, in the dtype
the engine holds it.

vLLM's CPU build repacks linear weights for its kernels and drops the originals, so what a worker holds
cannot be read back as HF tensors; the record is taken as each tensor loads instead (from the engine's own
checkpoint through `vllm_compat.tee_checkpoint_loads`, or from the trainer through a base commit). It
proves what the engine loaded; the parity probe proves how it then computes. The trainer compares the
record with its own digests (`sync.base_digest`) and sends only the tensors that differ.

Digesting costs a pass over every weight at each engine start (about 2.5 s of CPU for SmolLM2); an engine
started with `--titan-skip-base-digests` (a trainer with `[weight_sync] base = "push"`, which never asks)
sets SKIP_ENV for its workers, which then record nothing: the empty record makes any trainer that does ask
send the whole base.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping

import torch

from titan_lora.transfer.digest import tensor_digest

logger = logging.getLogger("titan_lora.engine")
SKIP_ENV = "TITAN_LORA_SKIP_BASE_DIGESTS"
"""Set to 1 by the engine's front for its workers (spawned after it): record nothing."""


def recording(env: Mapping[str, str]) -> bool:
    """Whether a worker started with `env` records digests (unless SKIP_ENV says not to)."""
    return env.get(SKIP_ENV) != "1"


RECORDING = recording(os.environ)
"""Whether this worker records (read once, at import: before the model loads)."""

_lock = threading.Lock()
_digests: dict[str, str] = {}
_loaded_dtype: torch.dtype | None = None  # the dtype of the last load


def _device() -> torch.device:
    # The worker's GPU digests a 70B checkpoint in seconds; its CPU would take many minutes.
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def record(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    """Record the digest of checkpoint tensor `name` as the engine holds it (cast to `dtype`)."""
    if not RECORDING or not tensor.is_floating_point():
        return  # skipped, or not a base weight titan_lora sends (quantisation scales, indices)
    digest = tensor_digest(name, tensor.to(device=_device(), dtype=dtype))
    global _loaded_dtype
    with _lock:
        _digests[name] = digest
        _loaded_dtype = dtype


def recorded() -> dict:
    """The record: the dtype and the digest of every tensor loaded so far (empty: nothing was loaded from a
    checkpoint, e.g. `--load-format dummy`)."""
    with _lock:
        dtype = None if _loaded_dtype is None else str(_loaded_dtype).removeprefix("torch.")
        return {"dtype": dtype, "digests": dict(_digests)}
