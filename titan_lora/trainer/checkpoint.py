"""Adapter-only checkpoints through DCP: adapter, optimizer, LR schedule and trainer state.

The frozen base is never written: it is reloaded from the pretrained checkpoint, so a checkpoint is
the size of the adapter and its optimizer state, and resuming works for any number of ranks.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from titan_lora.export.peft import PeftLayout
from titan_lora.lora.finite import NonFiniteAdapterError, first_nonfinite_adapter
from titan_lora.lora.layer import adapter_params, lora_modules
from titan_lora.lora.multi import adapter_of
from titan_lora.trainer.checkpoint_names import (
    NAMES,
    ROW_ORDER,
    TARGETS,
    adapter_peft_names,
    adapters_change,
    hf_targets,
    optimizer_state_param,
    peft_names,
    renamed_optimizer_state,
    renamed_params,
    saved_hf_targets,
    to_torchtitan_022,
)

logger = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step-(\d+)$")
SIGNATURE_FILE = "titan_lora_adapter.json"
"""Beside DCP's files: the LoRA rank and adapted modules (HF module names), compared before a resume, and the
tensor names (`checkpoint_names.NAMES`) and row order the checkpoint is stored in."""
DATA_STATE_FILE = "titan_lora_data.json"
"""Beside DCP's files, when the objective has one: its data position (the async loop's groups trained)."""


def complete_steps(folder: Path) -> list[int]:
    """Steps under `folder` that have a complete checkpoint (DCP writes `.metadata` last), oldest first."""
    if not folder.is_dir():
        return []
    found = [int(m.group(1)) for p in folder.iterdir() if (m := _STEP_DIR.match(p.name))]
    return sorted(s for s in found if (folder / f"step-{s}" / ".metadata").exists())


def named_adapter_signature(name: str, rank: int, targets: list[str], hf_modules: Mapping[str, str]) -> dict[str, Any]:
    """One adapter of several, as a checkpoint's signature lists it: its name, rank and adapted linears (HF names)."""
    return {"name": name, "lora_rank": rank, "target_modules": hf_targets(targets, hf_modules)}


def adapter_signature(rank: int, targets: list[str], hf_modules: Mapping[str, str]) -> dict[str, Any]:
    """What a checkpoint's adapter shapes depend on: the LoRA rank and the adapted linears, named as in the
    HF checkpoint (torchtitan's module paths change between releases)."""
    return {"lora_rank": rank, "target_modules": hf_targets(targets, hf_modules), "targets": TARGETS}


def check_resume_compatible(folder: Path, rank: int, targets: list[str], hf_modules: Mapping[str, str],
                            adapters: list[dict[str, Any]] | None = None) -> None:
    """Refuse to resume from a checkpoint whose adapter has another rank or other targets (torchtitan module
    paths `targets`, compared by their HF names through `hf_modules`); with several adapters (`adapters`:
    `adapter_signature` of each, in table order), one whose adapters differ in names, order, ranks or
    targets. Either way the message names the difference and the way out."""
    steps = complete_steps(folder)
    if not steps:
        return
    path = folder / f"step-{steps[-1]}"
    meta = path / SIGNATURE_FILE
    if not meta.exists():
        return  # written before signatures existed: DCP's own shape check is all there is
    saved = json.loads(meta.read_text())
    if adapters is not None or "adapters" in saved:
        change = (adapters_change(saved.get("adapters"), adapters) if adapters is not None else
                  f"it was saved by a job with the adapters {[a['name'] for a in saved['adapters']]}, this job "
                  "has one adapter")
        if change is not None:
            raise ValueError(f"cannot resume from {path}: {change}; keep the [[adapters]] tables as they were, or "
                             "start afresh with another [checkpoint] folder (or [job] dump_folder), or remove that "
                             "folder")
        return
    diff = sorted(set(saved_hf_targets(saved, hf_modules)) ^ set(hf_targets(targets, hf_modules)))
    if saved["lora_rank"] == rank and not diff:
        return
    if saved["lora_rank"] != rank:
        what = f"[lora] rank = {saved['lora_rank']}, this job has rank = {rank}"
    else:
        what = f"other [lora] target_modules (they differ in {diff[:4]}{' ...' if len(diff) > 4 else ''})"
    raise ValueError(
        f"cannot resume from {path}: it was saved with {what}; use the same [lora] settings, or start "
        "afresh with another [checkpoint] folder (or [job] dump_folder), or remove that folder"
    )


def check_steps_left(folder: Path, steps: int) -> None:
    """Refuse a run whose newest checkpoint already reaches `[training] steps`: it would train nothing."""
    saved = complete_steps(folder)
    if saved and saved[-1] >= steps:
        raise ValueError(
            f"nothing to train: {folder / f'step-{saved[-1]}'} is step {saved[-1]} and [training] steps = "
            f"{steps}; raise --training.steps above {saved[-1]} to go on from it, or start afresh with "
            "another [job] dump_folder (or [checkpoint] folder)"
        )


class AdapterCheckpointer:
    """Save every `interval` steps to `<folder>/step-N`, keep the newest `keep_latest` (0: all), resume from the
    newest."""

    def __init__(self, folder: str, model: nn.Module, layout: PeftLayout,
                 optimizers, lr_schedulers, interval: int, keep_latest: int,  # noqa: ANN001
                 adapters: list[str] | None = None) -> None:
        """`adapters`: the names of a K-adapter model's adapters, in table order (None: one adapter)."""
        self.adapters = adapters
        self.folder = Path(folder)
        self.model = model
        self.layout = layout
        self.hf_modules = layout.hf_modules
        self.optimizers = optimizers
        self.lr_schedulers = lr_schedulers
        self.interval = interval
        self.keep_latest = keep_latest
        self.data_state: dict | None = None
        """What the objective saved with the checkpoint `load_latest` restored (None: nothing)."""

    def _state(self, step: int, peft_named: bool = True) -> dict[str, Any]:
        # The adapter version is the step, and so is the data position of the sync loop (data is drawn
        # per step from a seeded order); the async loop's position goes beside it (DATA_STATE_FILE).
        adapter, optimizer = dict(adapter_params(self.model)), self.optimizers.state_dict()
        names = self._stored_names(peft_named)
        adapter = renamed_params(adapter, names)
        optimizer = renamed_optimizer_state(optimizer, names)
        return {"adapter": adapter, "optimizer": optimizer, "lr_scheduler": self.lr_schedulers.state_dict(),
                "trainer": {"step": step}}

    def _stored_names(self, peft_named: bool) -> dict[str, str]:
        """Each adapter parameter's key in a checkpoint: its PEFT name, or (checkpoints written before
        NAMES) its torchtitan 0.2.2 module path."""
        return self.names if peft_named else {fqn: to_torchtitan_022(fqn) for fqn in self.names}

    @functools.cached_property
    def names(self) -> dict[str, str]:
        """Each adapter parameter's stored name: its PEFT name, or with several adapters `<name>/<PEFT name>`;
        worked out at the first save or load (a job that keeps no checkpoint never needs it)."""
        fqns = [name for name, _ in adapter_params(self.model)]
        return adapter_peft_names(fqns, self.layout, self.adapters) if self.adapters else peft_names(fqns, self.layout)

    def steps(self) -> list[int]:
        """Steps that have a complete checkpoint, oldest first."""
        return complete_steps(self.folder)

    def should_save(self, step: int, last_step: int) -> bool:
        """True on every `interval`-th step and on the last one."""
        return self.interval > 0 and (step % self.interval == 0 or step == last_step)

    def save(self, step: int, data_state: dict | None = None) -> None:
        """Collective: write the checkpoint of `step` (with rank 0's `data_state`, when given), then prune old
        ones; refuses a non-finite adapter.

        Only finite adapters are ever saved, so pruning to the newest `keep_latest` always keeps the
        last finite checkpoint.
        """
        bad = first_nonfinite_adapter(self.model)
        if bad is not None:
            raise NonFiniteAdapterError(f"refusing to save the checkpoint of step {step}: adapter tensor "
                                        f"{bad} holds NaN/Inf; the earlier checkpoints are kept as they are")
        path = self.folder / f"step-{step}"
        if dist.get_rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
            (path / SIGNATURE_FILE).write_text(json.dumps(self._signature()))
            if data_state is not None:  # before DCP's .metadata, which marks the checkpoint complete
                (path / DATA_STATE_FILE).write_text(json.dumps(data_state))
        dcp.save(self._state(step), checkpoint_id=str(path))
        if dist.get_rank() == 0:
            for old in self.steps()[: -self.keep_latest] if self.keep_latest else []:
                shutil.rmtree(self.folder / f"step-{old}", ignore_errors=True)
            logger.info("saved checkpoint %s", path)
        dist.barrier()

    def _signature(self) -> dict[str, Any]:
        if self.adapters:
            return {"adapters": self._adapter_signatures(), "targets": TARGETS, "names": NAMES, "row_order": ROW_ORDER}
        modules = list(lora_modules(self.model))
        rank = modules[0][1].lora_A.shape[0] if modules else 0  # the global shape, also for DTensors
        signature = adapter_signature(rank, [name for name, _ in modules], self.hf_modules)
        return {**signature, "names": NAMES, "row_order": ROW_ORDER}

    def _adapter_signatures(self) -> list[dict[str, Any]]:
        """Each adapter's name, rank and adapted modules (HF names), in table order."""
        out = []
        for k, name in enumerate(self.adapters):
            a = [(fqn, p) for fqn, p in adapter_params(self.model) if fqn.endswith(f".lora_A_{k}")]
            out.append(named_adapter_signature(name, a[0][1].shape[0],  # the global shape, also for DTensors
                                               [fqn.rsplit(".", 1)[0] for fqn, _ in a], self.hf_modules))
        return out

    def load_latest(self) -> int:
        """Collective: restore the newest checkpoint in place; returns its step, or 0 when there is none."""
        steps = self.steps()
        if not steps:
            return 0
        path = self.folder / f"step-{steps[-1]}"
        signature = self._signature()  # the job's load checked the config already; this checks the model
        modules = [] if self.adapters else [name for name, _ in lora_modules(self.model)]
        check_resume_compatible(self.folder, signature.get("lora_rank", 0), modules, self.hf_modules,
                                signature.get("adapters"))
        saved = json.loads((path / SIGNATURE_FILE).read_text()) if (path / SIGNATURE_FILE).exists() else {}
        peft_named = saved.get("names") == NAMES
        if not peft_named:
            logger.warning("%s is keyed by torchtitan 0.2.2's module paths (saved before checkpoints used PEFT "
                           "names): resumed as such; the next checkpoint uses PEFT names", path)
        state = self._state(0, peft_named)
        dcp.load(state, checkpoint_id=str(path))
        ours = {stored: fqn for fqn, stored in self._stored_names(peft_named).items()}
        state["optimizer"] = renamed_optimizer_state(state["optimizer"], ours)  # its own parameter names back
        self.optimizers.load_state_dict(state["optimizer"])
        self.lr_schedulers.load_state_dict(state["lr_scheduler"])
        data = path / DATA_STATE_FILE
        self.data_state = json.loads(data.read_text()) if data.exists() else None
        logger.info("resumed from %s", path)
        return int(state["trainer"]["step"])

    def restore_adapter(self, k: int) -> int:
        """Collective: adapter `k` of a K-adapter model (its tensors and optimizer state) as the newest
        checkpoint holds it; every other adapter, the optimizer's param groups (learning rates), the LR schedule
        and the data position stay as they are. Returns the checkpoint's step."""
        others = {fqn: p.detach().clone() for fqn, p in adapter_params(self.model) if adapter_of(fqn) != k}
        optimizer = {key: value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
                     for key, value in self.optimizers.state_dict().items()}
        schedules, data_state = copy.deepcopy(self.lr_schedulers.state_dict()), self.data_state
        step = self.load_latest()
        with torch.no_grad():
            for fqn, param in adapter_params(self.model):
                if fqn in others:
                    param.copy_(others[fqn])
        restored = self.optimizers.state_dict()
        self.optimizers.load_state_dict({key: restored[key] if _restores(key, k) else value
                                         for key, value in optimizer.items()})
        self.lr_schedulers.load_state_dict(schedules)
        self.data_state = data_state
        return step


def _restores(key: str, k: int) -> bool:
    """Whether a flattened optimizer state key is adapter `k`'s state (its moments and step), which a rollback of
    that adapter takes from the checkpoint; its param group's keys (the learning rate the schedule set) are not."""
    parts = optimizer_state_param(key)
    return parts is not None and parts[0] == "state." and adapter_of(parts[1]) == k
