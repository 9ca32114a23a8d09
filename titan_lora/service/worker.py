"""The trainer side of the service: runs the calls the ledger hands out on the model, in rounds (every
client's ready forward/forward_backward in one mixed step, then the other calls in turn), and finishes each
call's future. One call's failure fails that future only."""

from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from titan_lora.service.futures import FutureStore, Result
from titan_lora.service.ledger import Ledger, Model, Op
from titan_lora.service.sampling import Publisher
from titan_lora.service.slots import AdapterSlots
from titan_lora.service.step import Limits, Work, run_step
from titan_lora.service.wire import write_forward_backward

logger = logging.getLogger(__name__)

STATE_PATH = re.compile(r"tinker://(?P<model>[^/]+)/weights/(?P<name>[^/]+)")
"""A state's `tinker://` path: the model that saved it and the name it was saved under."""
SAMPLER_PATH = re.compile(r"tinker://(?P<model>[^/]+)/sampler_weights/(?P<name>[^/]+)")
"""A named sampler save's `tinker://` path (an unnamed one, `save_weights_and_get_sampling_client`'s, is kept
only in the engine, as Tinker keeps it only for the session)."""
STATE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def key_digest(key: str) -> str:
    """An API key's digest, stored with its states (a state loads only for the key that saved it)."""
    return hashlib.sha256(key.encode()).hexdigest()


class Worker:
    """Runs calls on the trainer's model and finishes their futures."""

    def __init__(self, model: nn.Module, slots: AdapterSlots, limits: Limits, device: torch.device,
                 state_dir: str, ledger: Ledger, futures: FutureStore, publisher: Publisher | None = None,
                 group: dist.ProcessGroup | None = None) -> None:
        """`publisher`: puts a client's adapter into the engine for sampling (None: sampling is not served).
        `group`: the data-parallel ranks a mixed step splits its rows over (None: one)."""
        self.model, self.slots, self.limits, self.device = model, slots, limits, device
        self.state_dir = Path(state_dir)
        self.ledger, self.futures = ledger, futures
        self.publisher = publisher
        self.group = group
        self.writes = not dist.is_initialized() or dist.get_rank() == 0  # one rank writes each saved state

    def run(self, ops: list[Op]) -> None:
        """One round: creates, then one mixed step of the forward/forward_backward calls, then the rest."""
        for op in (o for o in ops if o.kind == "release"):
            self._release(op)
        for op in (o for o in ops if o.kind == "create"):
            self._guarded(op, self._create)
        steps = [o for o in ops if o.kind == "forward_backward"]
        if steps:
            self._mixed_step(steps)
        for op in (o for o in ops if o.kind not in ("release", "create", "forward_backward")):
            self._guarded(op, getattr(self, f"_{op.kind}"))

    def _guarded(self, op: Op, run: object) -> None:
        try:
            result = run(op)
        except (ValueError, FileNotFoundError, KeyError) as err:
            result = Result(error=str(err), category="user")
        except Exception as err:  # a call's fault fails its future, not the service
            logger.exception("%s of %s failed", op.kind, op.model_id)
            result = Result(error=f"{type(err).__name__}: {err}", category="server")
        self.futures.finish(op.request_id, result)

    def _create(self, op: Op) -> Result:
        model = self.ledger.models[op.model_id]
        try:
            if op.args is not None:  # create from a saved state (create_training_client_from_state)
                self._load_into(model.slot, model.key, *op.args)
            else:
                self.slots.claim(model.slot, model.spec)
        except BaseException:
            self.ledger.forget(op.model_id)
            raise
        self._adopt(model)  # a state's own spec when created from one
        self.ledger.created(op.model_id)
        logger.info("model %s: LoRA rank %d in slot %d", op.model_id, self.slots.specs[model.slot].rank, model.slot)
        if op.args is not None:  # the SDK awaits a LoadWeightsResponse for a create from a state
            return Result(json={"model_id": op.model_id, "path": op.args[0], "type": "load_weights"})
        return Result(json={"model_id": op.model_id, "type": "create_model"})

    def _adopt(self, model: Model) -> None:
        """The model takes its slot's spec as claimed or loaded; the engine scales the slot to match."""
        model.spec = self.slots.specs[model.slot]
        if self.publisher is not None:
            self.publisher.scale(model.slot, self.slots.alpha / model.spec.rank)

    def _release(self, op: Op) -> None:
        """A model whose session ended: its slot is freed, its queued calls fail."""
        slot = self.ledger.models[op.model_id].slot
        self.slots.release(slot)
        for left in self.ledger.forget(op.model_id):
            self.futures.finish(left.request_id, Result(error="the training client's session ended", category="user"))
        logger.info("model %s released (slot %d free)", op.model_id, slot)

    def _mixed_step(self, ops: list[Op]) -> None:
        works = [Work(self.ledger.models[o.model_id].slot, o.args) for o in ops]
        try:
            outcomes = run_step(self.model, works, self.slots.count, self.limits, self.device, self.group)
        except Exception as err:  # the step's fault fails its calls, not the service
            logger.exception("a mixed step of %d calls failed", len(ops))
            for op in ops:
                self.futures.finish(op.request_id, Result(error=f"{type(err).__name__}: {err}", category="server"))
            return
        for op, outcome in zip(ops, outcomes):
            if outcome.error is not None:
                self.futures.finish(op.request_id, Result(error=outcome.error, category="user"))
            else:
                self.futures.finish(op.request_id, Result(proto=write_forward_backward(outcome.logprobs,
                                                                                       outcome.metrics)))

    def _optim_step(self, op: Op) -> Result:
        metrics = self.slots.step(self.ledger.models[op.model_id].slot, op.args)
        return Result(json={"metrics": metrics, "type": "optim_step"})

    def _save_for_sampler(self, op: Op) -> Result:
        """Collective: the client's adapter into the engine as a new version; its path, and a sampling session
        on it when the SDK asked for a sampling client (`save_weights_and_get_sampling_client`)."""
        name, open_session = op.args
        if self.publisher is None:
            raise ValueError("sampling is not served: this service runs with [weight_sync] enabled = false")
        if name and not STATE_NAME.fullmatch(name):
            raise ValueError(f"sampler weights name {name!r}: use 1-128 letters, digits, '_', '.' or '-'")
        model = self.ledger.models[op.model_id]
        if name:  # a named save outlives the engine and the service: reloaded when sampled after a restart
            self._write(self._state_file(op.model_id, name, "sampler_weights"),
                        self.slots.state(model.slot, with_optimizer=False) | {"key": key_digest(model.key)})
        path, _, metrics = self.publisher.publish(model.key, op.model_id, model.slot, name)
        logger.info("model %s: %s published (sync %.0f ms, parity max |trainer - engine| %.2g)", op.model_id, path,
                    metrics.get("sync/total_ms", 0.0), metrics.get("sync/parity_max_abs", float("nan")))
        answer = {"path": path, "type": "save_weights_for_sampler"}
        if open_session and self.publisher.sampling is not None:
            answer["sampling_session_id"] = self.publisher.sampling.open(model.key, path)
        return Result(json=answer)

    def _state_file(self, model_id: str, name: str, folder: str = "") -> Path:
        """Where a model's saved state lies (named sampler weights: in its `folder` "sampler_weights")."""
        return self.state_dir / model_id.replace(":", "_") / folder / f"{name}.pt"

    def _write(self, path: Path, state: dict) -> None:
        """Save `state` at `path` from one rank, whole or not at all (a crash mid-write leaves the last)."""
        if self.writes:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, f"{path}.tmp")
            os.replace(f"{path}.tmp", path)

    def _read(self, file: Path, path: str, key: str) -> dict:
        """The state saved at `file` for `path`, if `key` saved it; else "no saved state", as for none."""
        state = torch.load(file, weights_only=True) if file.is_file() else None
        if state is None or state.get("key") != key_digest(key):  # another key's: not told apart from none
            raise FileNotFoundError(f"no saved state {path}")
        if state["spec"]["rank"] > self.slots.max_rank:
            raise ValueError(f"{path} has rank {state['spec']['rank']}; this service's max_rank is "
                             f"{self.slots.max_rank}")
        return state

    def _save_state(self, op: Op) -> Result:
        name = op.args
        if not STATE_NAME.fullmatch(name):
            raise ValueError(f"state name {name!r}: use 1-128 letters, digits, '_', '.' or '-'")
        model = self.ledger.models[op.model_id]
        state = self.slots.state(model.slot) | {"key": key_digest(model.key)}
        self._write(self._state_file(op.model_id, name), state)
        return Result(json={"path": f"tinker://{op.model_id}/weights/{name}", "type": "save_weights"})

    def _load_into(self, slot: int, key: str, path: str, with_optimizer: bool) -> None:
        match = STATE_PATH.fullmatch(path)
        if match is None:
            raise ValueError(f"{path!r} is not a state path: save_state returns tinker://<model>/weights/<name>")
        self.slots.load(slot, self._read(self._state_file(match["model"], match["name"]), path, key), with_optimizer)

    def _load_state(self, op: Op) -> Result:
        model = self.ledger.models[op.model_id]
        self._load_into(model.slot, model.key, *op.args)
        self._adopt(model)  # the state's rank and parts
        return Result(json={"path": op.args[0], "type": "load_weights"})

    def _restore_sampler(self, op: Op) -> Result:
        """Collective: named sampler weights saved before a restart back into the engine, through a borrowed
        slot (loaded, published as a new version of its family, freed), under their own path."""
        path, key, slot = op.args
        try:
            match = SAMPLER_PATH.fullmatch(path)
            if match is None or self.publisher is None:
                raise FileNotFoundError(f"no saved state {path}")
            state = self._read(self._state_file(match["model"], match["name"], "sampler_weights"), path, key)
            self.slots.load(slot, state, with_optimizer=False)
            self.publisher.scale(slot, self.slots.alpha / state["spec"]["rank"])
            self.publisher.publish(key, match["model"], slot, match["name"])
        finally:
            self.slots.release(slot)
            self.ledger.give_back(slot)
        logger.info("%s reloaded into the engine from %s", path, self.state_dir)
        return Result(json={"path": path})
