"""Adapter-only checkpoints through DCP: adapter, optimizer, LR schedule and trainer state.

The frozen base is never written: it is reloaded from the pretrained checkpoint, so a checkpoint is
the size of the adapter and its optimizer state, and resuming works for any number of ranks.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from titan_lora.lora.layer import adapter_params

logger = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step-(\d+)$")


class AdapterCheckpointer:
    """Save every `interval` steps to `<folder>/step-N`, keep the newest `keep_latest`, resume from the newest."""

    def __init__(self, folder: str, model: nn.Module, optimizers, lr_schedulers, interval: int, keep_latest: int) -> None:  # noqa: ANN001
        self.folder = Path(folder)
        self.model = model
        self.optimizers = optimizers
        self.lr_schedulers = lr_schedulers
        self.interval = interval
        self.keep_latest = keep_latest

    def _state(self, step: int) -> dict[str, Any]:
        # The data position and the adapter version are both the step: data is drawn per step
        # from a seeded order, and versions are training steps.
        return {
            "adapter": dict(adapter_params(self.model)),
            "optimizer": self.optimizers.state_dict(),
            "lr_scheduler": self.lr_schedulers.state_dict(),
            "trainer": {"step": step},
        }

    def steps(self) -> list[int]:
        """Steps that have a complete checkpoint, oldest first."""
        if not self.folder.is_dir():
            return []
        found = [int(m.group(1)) for p in self.folder.iterdir() if (m := _STEP_DIR.match(p.name))]
        return sorted(s for s in found if (self.folder / f"step-{s}" / ".metadata").exists())

    def should_save(self, step: int, last_step: int) -> bool:
        """True on every `interval`-th step and on the last one."""
        return self.interval > 0 and (step % self.interval == 0 or step == last_step)

    def save(self, step: int) -> None:
        """Collective: write the checkpoint of `step`, then prune old ones."""
        path = self.folder / f"step-{step}"
        dcp.save(self._state(step), checkpoint_id=str(path))
        if dist.get_rank() == 0:
            for old in self.steps()[: -self.keep_latest]:
                shutil.rmtree(self.folder / f"step-{old}", ignore_errors=True)
            logger.info("saved checkpoint %s", path)
        dist.barrier()

    def load_latest(self) -> int:
        """Collective: restore the newest checkpoint in place; returns its step, or 0 when there is none."""
        steps = self.steps()
        if not steps:
            return 0
        path = self.folder / f"step-{steps[-1]}"
        state = self._state(0)
        dcp.load(state, checkpoint_id=str(path))
        self.optimizers.load_state_dict(state["optimizer"])
        self.lr_schedulers.load_state_dict(state["lr_scheduler"])
        logger.info("resumed from %s", path)
        return int(state["trainer"]["step"])
