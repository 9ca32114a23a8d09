"""TensorBoard scalars and the one-line-per-step progress output (rank 0 only)."""

from __future__ import annotations

import logging
import resource
import sys
from collections.abc import Mapping

import torch

logger = logging.getLogger(__name__)


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory of this rank: CUDA allocator peak on GPU, process peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # ru_maxrss is KiB on Linux


class MetricsLogger:
    """Writes scalars to TensorBoard event files and prints a progress line; a no-op off rank 0."""

    def __init__(self, log_dir: str, enabled: bool) -> None:
        self.enabled = enabled
        self._writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir)
            logger.info("TensorBoard event files in %s", log_dir)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        """Record `scalars` (tag -> value) at `step`."""
        if self._writer is None:
            return
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, step)
        self._writer.flush()

    def prefixed(self, prefix: str) -> PrefixedMetrics:
        """This logger with every tag under `prefix` (one adapter's objective logs as `<name>/...`)."""
        return PrefixedMetrics(self, prefix)

    def progress(self, step: int, total: int, fields: Mapping[str, str]) -> None:
        """Print `step/total key=value ...` on one line."""
        if self.enabled:
            parts = " ".join(f"{k}={v}" for k, v in fields.items())
            print(f"step {step:>4}/{total} {parts}", file=sys.stdout, flush=True)

    def close(self) -> None:
        """Flush and close the event file."""
        if self._writer is not None:
            self._writer.close()


class PrefixedMetrics:
    """A `MetricsLogger` whose tags all start with `prefix`."""

    def __init__(self, inner: MetricsLogger, prefix: str) -> None:
        self.inner = inner
        self.prefix = prefix

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        """Record `scalars` under the prefix."""
        self.inner.log(step, {self.prefix + tag: value for tag, value in scalars.items()})
