"""The GRPO objective: rollouts from the live engine, group advantages, policy-gradient loss, optional KL."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from titan_lora.config import GRPO
from titan_lora.lora.layer import adapters_disabled
from titan_lora.rl.grpo import group_advantages, k3_kl, mismatch_kl, policy_loss, stale_weights
from titan_lora.rl.logprobs import LOGPROB_CHUNK_TOKENS, chunk_count, chunked_token_logprobs
from titan_lora.rl.producer import BusyClock
from titan_lora.rl.rewards import get_reward
from titan_lora.rl.rollout import Sample, draw_groups, greedy_accuracy, sample_groups, share
from titan_lora.rl.sample_source import Draws, SourceFactory
from titan_lora.rl.task import Task, task_prompt, train_and_heldout
from titan_lora.sync.engine_access import EngineRollouts
from titan_lora.sync.versions import Lease
from titan_lora.titan.parallel import DataParallelInfo
from titan_lora.transfer.errors import TransferError

logger = logging.getLogger(__name__)


def completion_batch(samples: list[Sample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs [N, T], labels [N, T], mask [N, T]) with mask 1 where a label is a completion token the
    policy sampled (`Sample.completion_mask`: an episode's tool and template tokens are 0)."""
    seqs = [s.prompt_ids + s.completion_ids for s in samples]
    width = max(len(q) for q in seqs) - 1
    inputs = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), width)
    for i, (q, s) in enumerate(zip(seqs, samples)):
        inputs[i, : len(q) - 1] = torch.tensor(q[:-1])
        labels[i, : len(q) - 1] = torch.tensor(q[1:])
        sampled = s.completion_mask if s.completion_mask is not None else [1] * len(s.completion_ids)
        mask[i, len(s.prompt_ids) - 1 : len(q) - 1] = torch.tensor(sampled, dtype=mask.dtype)
    return inputs, labels, mask


_TOKENIZER_LOCKS: dict[int, threading.Lock] = {}
_LOCKS_LOCK = threading.Lock()


def tokenizer_lock(tokenizer: object) -> threading.Lock:
    """One lock per tokenizer object: a fast tokenizer is not reentrant, and the objectives of several adapters
    share one tokenizer and draw from their own threads at once."""
    with _LOCKS_LOCK:
        return _TOKENIZER_LOCKS.setdefault(id(tokenizer), threading.Lock())


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """One step's samples and this rank's share of the trainable ones, as model inputs."""

    samples: list[Sample]
    """Every sample the step took (its reward errors are counted)."""
    fresh: list[Sample]
    """The trainable ones (not too stale), on every rank."""
    mine: list[Sample]
    """This rank's share of `fresh`: the rows of the tensors below."""
    inputs: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor
    current: int
    """The version the engine serves as the step starts."""


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class GRPOObjective:
    """One GRPO step per optimizer step, near-on-policy by default (staleness <= 1, one minibatch).

    `loop`: where a step's samples come from (`rl/sample_source.py`: `sample_source` picks it from `[grpo]
    loop`, resumed at the checkpoint's data position). `record`: a JSONL file that gets one line per step
    with its groups, their versions and staleness (rank 0)."""

    logprob_chunk_tokens = LOGPROB_CHUNK_TOKENS

    def __init__(self, cfg: GRPO, task: Task, tokenizer, engine: EngineRollouts | None,  # noqa: ANN001
                 dp: DataParallelInfo, device: torch.device, metrics_logger,  # noqa: ANN001
                 loop: SourceFactory, record: str = "", name: str = "") -> None:
        """`name`: the adapter it trains in a job with several (its log lines name it)."""
        self.cfg = cfg
        self.name = name
        self.tokenizer = tokenizer
        self.engine = engine
        self.dp = dp
        self.device = device
        self.metrics_logger = metrics_logger
        self.train_problems, self.heldout = train_and_heldout(task, cfg.train_size, cfg.eval_size, cfg.seed)
        self._tokenizing = tokenizer_lock(tokenizer)  # producer threads (and other adapters' objectives) encode at once
        self._bind_task(task)
        self.stop_ids = [tokenizer.eos_token_id]
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eval_failures = 0
        self.clock = BusyClock()  # rank 0: when rollout requests run, for the phase figures
        versions = engine.versions if engine is not None and engine.client is not None else None  # rank 0
        self.source = loop(Draws(self._draw_step_at, self._draw_group, versions, self.clock))
        self._record = record
        self._problems_cache: tuple[int, list] | None = None
        self._wait_s = 0.0
        if not cfg.rollouts:
            logger.warning("[grpo] rollouts = false: this job runs NO rollouts; samples are the data's own "
                           "answers and scrambled ones, for timing the train + sync step only")

    def _bind_task(self, task: Task) -> None:
        """The reward and the prompts of a task whose samples are completions of one prompt."""
        self.reward = get_reward(self.cfg.reward) if self.cfg.reward else task.reward
        self.encode = lambda p: self._encode(lambda: task_prompt(self.tokenizer, task, p.question, p.system))
        self.heldout_ids = [self.encode(p) for p in self.heldout]

    def _encode(self, prompt: Callable[[], str]) -> list[int]:
        with self._tokenizing:
            return self.tokenizer(prompt(), add_special_tokens=False)["input_ids"]

    def _problems_at(self, step: int) -> list:
        cached = self._problems_cache  # one read: producer threads replace it concurrently
        if cached is None or cached[0] != step:
            rng = random.Random(self.cfg.seed * 100_003 + step)  # data position = step: resumable
            cached = self._problems_cache = (step, rng.sample(self.train_problems, self.cfg.prompts_per_step))
        return cached[1]

    def _seed(self, step: int) -> int:
        return self.cfg.seed * 1_000_003 + step * 1_009

    def _draw_step_at(self, step: int) -> list[Sample]:
        """Rank 0, sync loop: step `step`'s groups, drawn now."""
        return self._draw_step(self._problems_at(step), step)

    def _draw_group(self, index: int, lease: Lease) -> list[Sample]:
        """Rank 0, a producer thread: group `index` (prompt index % B of step index // B + 1) under `lease`."""
        step, k = divmod(index, self.cfg.prompts_per_step)
        problem = self._problems_at(step + 1)[k]
        samples = draw_groups(self.engine.client, lease, [problem], [self.encode(problem)], self.cfg.group_size,
                              self.cfg.max_new_tokens, self.cfg.temperature,
                              self._seed(step + 1) + k * self.cfg.group_size, self.stop_ids, self.reward)
        for s in samples:
            s.group = index
        return samples

    def _greedy_accuracy(self) -> float:
        """Rank 0: held-out greedy accuracy under the active adapter version."""
        active = self.engine.versions.active
        return greedy_accuracy(self.engine.client, active.name if active else None, self.heldout,
                               self.heldout_ids, self.cfg.max_new_tokens, self.stop_ids, self.reward)

    def _heldout_eval(self) -> dict[str, float]:
        """Rank 0: the held-out metrics (`eval/accuracy`) under the active adapter version."""
        return {"eval/accuracy": self._greedy_accuracy()}

    def _evaluate(self, step: int) -> dict[str, float]:
        """Collective: held-out accuracy (rank 0); a failure is logged and counted, never raised."""
        if self.engine is None or not self.cfg.rollouts or not self.cfg.eval_every:
            return {}
        try:
            evaluated = self.engine.call(self._heldout_eval, f"held-out eval at step {step}")
        except TransferError as err:  # diagnostics never end the run
            self.eval_failures += 1
            logger.warning("held-out eval at step %d failed (%s); %d eval failures so far",
                           step, err, self.eval_failures)
            return {"eval/failures": self.eval_failures}
        if evaluated is None:  # ranks other than 0
            return {}
        extra = "".join(f", {k.removeprefix('eval/')} {v:.3f}" for k, v in evaluated.items() if k != "eval/accuracy")
        of = f" of {self.name}" if self.name else ""
        logger.info("held-out accuracy%s at step %d: %.3f%s", of, step, evaluated["eval/accuracy"], extra)
        return {**evaluated, "eval/failures": self.eval_failures}

    def before_training(self, step: int) -> None:
        """Held-out accuracy before any update (the loop has synced the engine); then the sample source starts
        (the async loop's producer begins drawing)."""
        self._trim_record(step)
        if evaluated := self._evaluate(step):
            self.metrics_logger.log(step, evaluated)
        self.source.start(step)
        self.clock.lap()  # the phase figures of step 1 start here

    def _samples(self, step: int) -> list[Sample]:
        """Collective: the step's samples on every rank (rank 0 draws or takes them, with engine recovery)."""
        started = time.monotonic()
        try:
            return self._step_samples(step)
        finally:
            self._wait_s = time.monotonic() - started

    def _step_samples(self, step: int) -> list[Sample]:
        if not self.cfg.rollouts:
            offline = self._offline_samples(self._problems_at(step), step) if dist.get_rank() == 0 else None
            return share(offline)
        # Every rank calls it (the source takes on rank 0): a dead engine is restarted and re-synced
        # collectively; failure raises.
        return share(self.engine.call(lambda: self.source.take(step), f"rollouts of step {step}"))

    def _draw_step(self, problems: list, step: int) -> list[Sample]:
        """Rank 0, sync loop: the step's groups, group after group (`Sample.group`: the problem's index)."""
        samples = sample_groups(self.engine.client, self.engine.versions, problems,
                                [self.encode(p) for p in problems], self.cfg.group_size, self.cfg.max_new_tokens,
                                self.cfg.temperature, self._seed(step), self.stop_ids, self.reward)
        for i, s in enumerate(samples):
            s.group = i // self.cfg.group_size
        return samples

    def _offline_samples(self, problems: list, step: int) -> list[Sample]:
        out = []
        for p in problems:
            prompt = self.encode(p)
            for g in range(self.cfg.group_size):
                answer = str(p.answer) + ("" if g % 2 == 0 else str(g))  # any suffix makes it wrong
                ids = self.tokenizer(answer + self.tokenizer.eos_token, add_special_tokens=False)["input_ids"]
                out.append(Sample(prompt, ids, [0.0] * len(ids), float(g % 2 == 0), 0.0, step - 1, answer))
        adv = group_advantages(torch.tensor([s.reward for s in out]), self.cfg.group_size)
        for s, a in zip(out, adv.tolist()):
            s.advantage = a
        return out

    def loss(self, model: nn.Module, step: int) -> tuple[torch.Tensor, dict[str, float]]:
        """The GRPO loss on this rank's share of the step's samples, normalised by global tokens.

        Decoupled PPO with one update per batch: the ratio is taken against the current (proximal) policy,
        and a sample drawn under an older version is weighed by pi_current / pi_behaviour, the engine's
        log-probs as the behaviour policy, truncated at `[grpo] stale_weight_cap`."""
        batch = self.step_batch(self._samples(step), step)
        chunks = chunk_count(batch.mask, self.logprob_chunk_tokens, self.dp.group)
        logp = chunked_token_logprobs(model, batch.inputs, batch.labels, batch.mask, chunks)
        ref = None
        if self.cfg.kl_coef > 0:
            with torch.no_grad(), adapters_disabled(model):
                ref = chunked_token_logprobs(model, batch.inputs, batch.labels, batch.mask, chunks)
        return self.step_loss(step, batch, logp, ref)

    def step_batch(self, samples: list[Sample], step: int) -> StepBatch:
        """This rank's share of the step's trainable samples, as model inputs (the stale ones dropped)."""
        current = step - 1  # the version the engine serves when step `step` starts
        fresh = self.source.trainable(samples, current)
        share_n = len(fresh) // self.dp.size
        mine = fresh[self.dp.rank * share_n : (self.dp.rank + 1) * share_n]
        inputs, labels, mask = (t.to(self.device) for t in completion_batch(mine, self.pad_id))
        return StepBatch(samples, fresh, mine, inputs, labels, mask, current)

    def step_loss(self, step: int, batch: StepBatch, logp: torch.Tensor,
                  ref: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of `batch` from the policy's log-probs `logp` of its labels (`ref`: the base's, for the KL),
        normalised by the step's global token count; and the step's metrics."""
        mine, fresh, mask, current = batch.mine, batch.fresh, batch.mask, batch.current
        adv = torch.tensor([s.advantage for s in mine], device=self.device)
        engine = self._engine_logprobs(mine, logp)
        staleness = torch.tensor([[current - s.version] for s in mine], device=self.device)
        per_token = policy_loss(logp, adv) * stale_weights(logp, engine, staleness > 0, self.cfg.stale_weight_cap)
        kl = torch.zeros_like(per_token)
        if ref is not None:
            kl = k3_kl(logp, ref)
            per_token = per_token + self.cfg.kl_coef * kl
        gap = self._engine_gap(logp.detach(), engine, mask * (staleness == 0))
        by_staleness = self._mismatch_by_staleness(engine, logp, mask, staleness)
        sums = torch.stack([mask.sum(), (per_token * mask).sum().detach(), (kl * mask).sum().detach(),
                            gap[0], gap[1], gap[2], *by_staleness])
        if self.dp.group is not None:
            dist.all_reduce(sums[:4], group=self.dp.group)
            dist.all_reduce(sums[4:5], op=dist.ReduceOp.MAX, group=self.dp.group)
            dist.all_reduce(sums[5:], group=self.dp.group)
        tokens = float(sums[0])
        loss = (per_token * mask).sum() / tokens
        rewards = torch.tensor([s.reward for s in fresh])
        ages = [current - s.version for s in fresh]
        self._write_record(step, fresh)
        return loss, {
            "loss": float(sums[1]) / tokens, "rl/reward_mean": float(rewards.mean()),
            "rl/reward_std": float(rewards.std(unbiased=False)), "rl/kl": float(sums[2]) / tokens,
            "rl/response_len": sum(s.sampled_len for s in fresh) / max(len(fresh), 1),
            "rl/logprob_gap_mean": float(sums[3]) / max(float(sums[5]), 1.0), "rl/logprob_gap_max": float(sums[4]),
            "rl/dropped_stale": self.source.dropped(),
            "rl/samples": len(fresh),
            "rl/reward_errors": sum(s.reward_error for s in batch.samples),  # this step's, each scored 0
            "rl/sample_version": float(min(s.version for s in fresh)),
            "rl/staleness_mean": sum(ages) / max(len(ages), 1), "rl/staleness_max": float(max(ages, default=0)),
            **self._mismatch_metrics(sums[6:]),
            "phase/rollout_wait_s": self._wait_s,
        }

    def _mismatch_by_staleness(self, engine: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor,
                               staleness: torch.Tensor) -> list[torch.Tensor]:
        """(KL sum, token count) of the behaviour-vs-current mismatch for each staleness 0..S."""
        if not self.cfg.rollouts:
            return []
        kl = mismatch_kl(engine, logp) * mask
        out = []
        for age in range(self.cfg.max_staleness + 1):
            rows = staleness == age
            out += [(kl * rows).sum(), (mask * rows).sum()]
        return out

    @staticmethod
    def _mismatch_metrics(sums: torch.Tensor) -> dict[str, float]:
        """`rl/mismatch_kl_s<age>`: mean per-token KL(behaviour || current) of the samples that old."""
        return {f"rl/mismatch_kl_s{age}": float(sums[2 * age]) / float(sums[2 * age + 1])
                for age in range(len(sums) // 2) if float(sums[2 * age + 1]) > 0}

    def _trim_record(self, step: int) -> None:
        """Rank 0: drop the record's lines of steps after `step`, which a killed run wrote and this resumed
        one trains again, so the file holds each step once."""
        if not self._record or not _rank0() or not os.path.exists(self._record):
            return
        with open(self._record) as f:
            kept = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
        with open(self._record, "w") as f:
            f.writelines(kept)

    def _write_record(self, step: int, samples: list[Sample]) -> None:
        """Rank 0: one JSONL line per step: its groups in data order, the version each was drawn under."""
        if not self._record or not _rank0():
            return
        groups = {}
        for s in samples:
            groups.setdefault(s.group, s.version)
        line = {"step": step, "groups": list(groups), "versions": list(groups.values()),
                "staleness": [step - 1 - v for v in groups.values()]}
        with open(self._record, "a") as f:
            f.write(json.dumps(line) + "\n")

    @staticmethod
    def _engine_logprobs(mine: list[Sample], like: torch.Tensor) -> torch.Tensor:
        """The engine's log-prob of each completion token, at the positions `like` holds them."""
        engine = torch.zeros_like(like)
        for i, s in enumerate(mine):
            start = len(s.prompt_ids) - 1
            engine[i, start : start + len(s.engine_logprobs)] = torch.tensor(s.engine_logprobs)
        return engine

    def _engine_gap(self, trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(sum, max, count) of |trainer - engine| log-probs over the masked completion tokens."""
        if not self.cfg.rollouts:
            return torch.zeros(3, device=trainer.device)
        diff = (trainer - engine).abs() * mask
        return torch.stack([diff.sum(), diff.max(), mask.sum()])

    def after_step(self, step: int) -> dict[str, float]:
        """The engine's share of the step (rank 0), and held-out accuracy every `eval_every` steps."""
        self.source.after_step()
        metrics = self._evaluate(step) if self.cfg.eval_every and step % self.cfg.eval_every == 0 else {}
        wall, busy, tokens = self.clock.lap()
        if not _rank0() or not self.cfg.rollouts:
            return metrics
        return {**metrics, **self.source.metrics(), "phase/engine_busy_s": busy,
                "phase/engine_idle_s": max(wall - busy, 0.0), "phase/gen_tokens_per_s": tokens / wall if wall > 0 else 0.0}

    def progress_fields(self, metrics: dict[str, float]) -> dict[str, str]:
        """Reward, accuracy (when measured), step and sync times."""
        fields = {"reward": f"{metrics['rl/reward_mean']:.3f}", "loss": f"{metrics['loss']:+.4f}",
                  "len": f"{metrics['rl/response_len']:.1f}", "step_s": f"{metrics['step_time_s']:.1f}"}
        if "sync/total_ms" in metrics:
            fields["sync_ms"] = f"{metrics['sync/total_ms']:.0f}"
        if "sync/probe_ms" in metrics:  # the parity probe's share of sync_ms, on the steps that run it
            fields["probe_ms"] = f"{metrics['sync/probe_ms']:.0f}"
        if "phase/engine_idle_s" in metrics:
            fields["wait_s"] = f"{metrics['phase/rollout_wait_s']:.1f}"
            fields["idle_s"] = f"{metrics['phase/engine_idle_s']:.1f}"
        fields |= self.source.progress_fields(metrics)
        if "eval/accuracy" in metrics:
            fields["heldout_acc"] = f"{metrics['eval/accuracy']:.3f}"
        return fields

    def data_state(self) -> dict | None:
        """Rank 0: the data position a checkpoint saved now keeps (None: the step is it)."""
        return self.source.data_state()

    def close(self) -> None:
        """Stop the sample source (the engine belongs to the run)."""
        self.source.close()
