"""GRPO on several adapters in one job: each adapter a `GRPOObjective` of its own (task, reward, seed, prompts,
held-out eval, family of versions), their rollouts drawn together and their rows trained in one batch.

Rank 0 draws every adapter's groups at once, one thread per adapter, so the engine batches requests of several
adapters together (vLLM serves many adapters in one batch). The step's rows go through the model in one
forward, grouped by adapter (`multi_rows`), or (`backward_each`, `[grpo] adapter_batches`) in one forward and
one backward per adapter, the gradients accumulating: the activations of one adapter's rows at a time. The loss
is the sum of each adapter's own GRPO loss, normalised by its own tokens: every adapter gets the gradient its
one-adapter job would get from the same samples, either way.
"""

from __future__ import annotations

from collections.abc import Sequence
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_lora.lora.layer import adapters_disabled
from titan_lora.lora.multi_rows import AdapterRows
from titan_lora.rl.logprobs import LOGPROB_CHUNK_TOKENS, chunk_count, chunked_token_logprobs
from titan_lora.rl.objective import GRPOObjective, StepBatch
from titan_lora.rl.rollout import Sample, share
from titan_lora.sync.engine_access import EngineRollouts
from titan_lora.trainer.host_memory import release_freed_host_memory

JOB_TOTALS = ("rl/samples", "rl/reward_errors")
"""Per-adapter figures the job's totals add up; the job's `rl/reward_mean` is the mean over adapters."""


def padded_rows(batches: Sequence[StepBatch], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every batch's (inputs, labels, mask) rows in order, right-padded to the widest (mask 0 there)."""
    width = max(b.mask.shape[1] for b in batches)

    def pad(t: torch.Tensor, value: float) -> torch.Tensor:
        return F.pad(t, (0, width - t.shape[1]), value=value)

    return (torch.cat([pad(b.inputs, pad_id) for b in batches]), torch.cat([pad(b.labels, pad_id) for b in batches]),
            torch.cat([pad(b.mask, 0.0) for b in batches]))


def base_logprobs(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, chunks: int,
                  rows: AdapterRows) -> torch.Tensor:
    """The base model's log-probs of `labels` (every adapter off, no graph): the KL term's reference."""
    with torch.no_grad(), adapters_disabled(model):
        return chunked_token_logprobs(model, inputs, labels, mask, chunks, rows)


class MultiGRPOObjective:
    """One GRPO step per optimizer step for every adapter (`objectives`, in adapter order, named `names`)."""

    logprob_chunk_tokens = LOGPROB_CHUNK_TOKENS

    def __init__(self, objectives: Sequence[GRPOObjective], names: Sequence[str], engine: EngineRollouts,
                 backward_each: bool = False) -> None:
        self.backward_each = backward_each
        self.objectives = list(objectives)
        self.names = list(names)
        self.engine = engine
        self._pool = ThreadPoolExecutor(len(self.objectives), thread_name_prefix="titan-adapter-rollouts")
        self._drawn_step, self._drawn = 0, {}  # rank 0: the adapters whose samples of that step are taken

    def before_training(self, step: int) -> None:
        """Each adapter's held-out eval before any update, then its sample source starts."""
        for objective in self.objectives:
            objective.before_training(step)

    def _draw_all(self, step: int) -> list[list[Sample]]:
        """Rank 0: every adapter's groups of step `step`, drawn at once (one thread each). Every draw ends before
        a failure is raised: a retry after the engine's recovery must not run beside a draw still going. The
        retry draws only for the adapters that failed: an async loop's take hands its groups once, and the
        groups it handed are this step's."""
        if self._drawn_step != step:
            self._drawn_step, self._drawn = step, {}
        missing = [k for k in range(len(self.objectives)) if k not in self._drawn]
        draws = {k: self._pool.submit(self.objectives[k].source.take, step) for k in missing}
        futures_wait(draws.values())
        for k, draw in draws.items():
            if draw.exception() is None:
                self._drawn[k] = draw.result()
        for draw in draws.values():
            draw.result()  # the first failure, after every draw ended and the others' samples were kept
        return [self._drawn[k] for k in range(len(self.objectives))]

    def _samples(self, step: int) -> list[list[Sample]]:
        """Collective: each adapter's samples of the step on every rank (rank 0 draws, with engine recovery)."""
        if not self.objectives[0].cfg.rollouts:
            return [objective._samples(step) for objective in self.objectives]
        return share(self.engine.call(lambda: self._draw_all(step), f"rollouts of step {step}"))

    def loss(self, model: nn.Module, step: int) -> tuple[torch.Tensor, dict[str, float]]:
        """The sum of every adapter's GRPO loss on its own rows, from one forward over all of them; with
        `backward_each`, from one forward per adapter, each followed by its backward (the sum returned carries
        no graph then: the training loop has no backward left to run)."""
        started = time.monotonic()
        drawn = self._samples(step)
        wait_s = time.monotonic() - started
        batches = [o.step_batch(samples, step) for o, samples in zip(self.objectives, drawn)]
        inputs, labels, mask = padded_rows(batches, self.objectives[0].pad_id)
        rows = AdapterRows(tuple(len(b.mine) for b in batches))
        group = self.objectives[0].dp.group
        kl = self.objectives[0].cfg.kl_coef > 0  # one [grpo] kl_coef for every adapter
        if not self.backward_each:
            chunks = chunk_count(mask, self.logprob_chunk_tokens, group)
            logp = chunked_token_logprobs(model, inputs, labels, mask, chunks, rows)
            ref = base_logprobs(model, inputs, labels, mask, chunks, rows) if kl else None
        total, metrics = None, {}
        for k, (name, objective, batch) in enumerate(zip(self.names, self.objectives, batches)):
            first, last = rows.bounds(k)
            if self.backward_each:  # every rank runs the same K forwards and backwards (FSDP gathers in each)
                own = slice(first, last)
                chunks = chunk_count(mask[own], self.logprob_chunk_tokens, group)
                logp_k = chunked_token_logprobs(model, inputs[own], labels[own], mask[own], chunks,
                                                rows.within(first, last))
                ref_k = base_logprobs(model, inputs[own], labels[own], mask[own], chunks,
                                      rows.within(first, last)) if kl else None
            else:
                logp_k = logp[first:last]
                ref_k = ref[first:last] if kl else None
            width = batch.mask.shape[1]
            loss, own_metrics = objective.step_loss(step, batch, logp_k[:, :width],
                                                    ref_k[:, :width] if kl else None)
            if self.backward_each and loss.requires_grad:
                loss.backward()
                loss = loss.detach()
                if inputs.device.type == "cpu":  # this adapter's freed activations, before the next one's
                    del logp_k
                    release_freed_host_memory()
            total = loss if total is None else total + loss
            own_metrics.pop("phase/rollout_wait_s")  # one wait for all adapters, measured here
            metrics |= {f"{name}/{key}": value for key, value in own_metrics.items()}
        metrics["loss"] = sum(metrics[f"{name}/loss"] for name in self.names)
        metrics["rl/reward_mean"] = sum(metrics[f"{name}/rl/reward_mean"] for name in self.names) / len(self.names)
        for key in JOB_TOTALS:
            metrics[key] = sum(metrics[f"{name}/{key}"] for name in self.names)
        for key, over in (("rl/staleness_mean", statistics.fmean), ("rl/staleness_max", max)):
            metrics[key] = over(metrics[f"{name}/{key}"] for name in self.names)
        metrics["phase/rollout_wait_s"] = wait_s
        return total, metrics

    def after_step(self, step: int) -> dict[str, float]:
        """Each adapter's after-step figures (held-out eval when due), under its name."""
        out = {}
        for name, objective in zip(self.names, self.objectives):
            out |= {f"{name}/{key}": value for key, value in objective.after_step(step).items()}
        return out

    def progress_fields(self, metrics: dict[str, float]) -> dict[str, str]:
        """Each adapter's reward (and held-out accuracy when measured), then the step and sync times."""
        fields = {}
        for name in self.names:
            fields[f"{name}.reward"] = f"{metrics[f'{name}/rl/reward_mean']:.3f}"
            if f"{name}/eval/accuracy" in metrics:
                fields[f"{name}.acc"] = f"{metrics[f'{name}/eval/accuracy']:.3f}"
        fields |= self.objectives[0].source.progress_fields(metrics)  # the loop's own (async: the staleness)
        fields["step_s"] = f"{metrics['step_time_s']:.1f}"
        if "sync/total_ms" in metrics:
            fields["sync_ms"] = f"{metrics['sync/total_ms']:.0f}"
        return fields

    def data_state(self) -> dict | None:
        """Rank 0: each adapter's data position by name (the async loop's groups trained so far); None when the
        step is every adapter's position (the sync loop)."""
        states = {name: o.source.data_state() for name, o in zip(self.names, self.objectives)}
        return states if any(state is not None for state in states.values()) else None

    def close(self) -> None:
        """Stop every adapter's sample source and the drawing threads."""
        for objective in self.objectives:
            objective.close()
        self._pool.shutdown(wait=True)
