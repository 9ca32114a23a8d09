"""Entry point: `torchrun --nproc_per_node=N -m titan_lora.train --job.config_file train_configs/x.toml`.

Reuses torchtitan 0.3.0's parts (model config trees, ParallelDims, parallelize, optimizers, LR schedules,
state-dict adapters), all through the seam `titan_lora.titan`, with a device-agnostic loop, so the same job
runs on CPU (gloo) and GPU (NCCL).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from titan_lora.compose import (
    EngineSide, adapter_source, build_objective, build_sync, check_plugins, engine_side,
)
from titan_lora.config import JobConfig, process_group_timeout_s
from titan_lora.config_adapters import job_adapters
from titan_lora.lora.finite import NonFiniteAdapterError, first_nonfinite_adapter
from titan_lora.lora.multi import adapter_of
from titan_lora.lora.multi_optim import adapter_optimizer_groups, clip_per_adapter
from titan_lora.lora.multi_rows import route
from titan_lora.lora.replicated import one_sum_for_the_step
from titan_lora.models.resolve import ResolvedModel
from titan_lora.rl.prompt_lengths import check_prompt_lengths
from titan_lora.rl.task import Task
from titan_lora.titan.optim import build_lr_schedulers, build_optimizers, clip_grad_norm_
from titan_lora.titan.parallel import build_parallel_dims
from titan_lora.trainer.build import build_model
from titan_lora.trainer.checkpoint import AdapterCheckpointer
from titan_lora.trainer.distributed import device_for_rank, end_with_launcher, init_distributed, leave_distributed
from titan_lora.trainer.job_config import load_job
from titan_lora.trainer.metrics import MetricsLogger, peak_memory_mib

logger = logging.getLogger("titan_lora")


class TrainingRun:
    """Everything one job needs, built in data-flow order: config, model, optimizer, data, sync.

    `task` is what `check_plugins` built (None when the job uses no task)."""

    def __init__(self, job_config: JobConfig, task: Task | None = None,
                 model: ResolvedModel | None = None) -> None:
        """`model`: `[model]` as `load_job` resolved it (None: resolved while building)."""
        self.cfg = job_config
        self.device = device_for_rank()
        init_distributed(self.device, process_group_timeout_s(job_config.weight_sync))
        self.rank = dist.get_rank()
        self.dims = build_parallel_dims(job_config.parallelism, dist.get_world_size(), self.device)
        torch.manual_seed(job_config.debug.seed or 0)
        self.built = build_model(job_config, self.dims, self.device, model)
        self.model = self.built.model
        # Several [[adapters]]: one optimizer param group each (its own lr, betas, ...; the LR schedule scales
        # each group), its own clipping and, in the objective, its own rows and data.
        self.adapters = job_adapters(job_config) if len(job_config.adapters) > 1 else []
        self.optimizers = build_optimizers(self.model, job_config, adapter_optimizer_groups(self.adapters))
        self.lr_schedulers = build_lr_schedulers(self.optimizers, job_config)
        dump = job_config.job.dump_folder
        self.metrics = MetricsLogger(os.path.join(dump, "tb"), enabled=self.rank == 0)
        self.checkpointer = AdapterCheckpointer(
            os.path.join(dump, job_config.checkpoint.folder), self.model, self.built.peft_layout,
            self.optimizers, self.lr_schedulers,
            job_config.checkpoint.interval if job_config.checkpoint.enable else 0,
            job_config.checkpoint.keep_latest_k, [a.name for a in self.adapters] or None,
        )
        side = engine_side(job_config, self.built, self.device)
        try:
            self._build_sync_side(job_config, side, task)
            self.objective = build_objective(job_config, self.built.hf_dir, self.dims, self.device, self.metrics,
                                             self.engine_rollouts, task, self.checkpointer.data_state)
        except BaseException:
            side.stop()  # what this run started: a failed start-up must not leave it behind
            raise
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.rollbacks = 0
        n_train = sum(p.numel() for p in self.trainable)
        logger.info(
            "rank %d/%d on %s: %s trainable params (%.3f%% of the model), starting at step %d",
            self.rank, dist.get_world_size(), self.device, f"{n_train:,}",
            100 * n_train / sum(p.numel() for p in self.model.parameters()), self.step,
        )

    def _build_sync_side(self, job_config: JobConfig, side: EngineSide, task: Task | None) -> None:
        """The adapter source (gathering into the buffer the emitter lends), the resumed step, the syncer."""
        self.adapter = adapter_source(job_config, self.built, side)
        self.step = self.checkpointer.load_latest() if job_config.checkpoint.enable else 0
        self.syncer, self.engine_rollouts = None, None
        if job_config.weight_sync.enabled:
            self.syncer, self.engine_rollouts = build_sync(job_config, self.adapter, self.built, self.device, side,
                                                           task)

    def train_step(self) -> dict[str, float]:
        """One optimizer step; returns its metrics."""
        self.optimizers.zero_grad()
        try:
            with one_sum_for_the_step(self.model):  # replicated adapters: one sum over the ranks, after every backward
                loss, metrics = self.objective.loss(self.model, self.step)
                if loss.requires_grad:  # else the objective ran its backwards (one per adapter)
                    loss.backward()
        finally:
            route(self.model, None)  # several adapters: the rows the objective routed for this step
        if self.adapters:  # each adapter clipped by its own norm; one with a NaN/Inf gradient skips the step
            (group_list,) = [opt.param_groups for opt in self.optimizers.optimizers]
            norms = clip_per_adapter(group_list, [a.max_norm for a in self.adapters], [a.name for a in self.adapters])
            metrics |= {f"{a.name}/grad_norm": n for a, n in zip(self.adapters, norms.norms)}
            grad_norm = norms.total
        else:
            grad_norm = clip_grad_norm_(self.trainable, self.cfg.training.max_norm, foreach=True)
        self.optimizers.step()
        self.lr_schedulers.step()
        return {**metrics, "grad_norm": float(grad_norm)}

    def check_and_sync(self) -> dict[str, float]:
        """Collective, after the optimizer step: stop or roll back on a non-finite adapter; then sync."""
        while (bad := first_nonfinite_adapter(self.model)) is not None:  # several adapters: each rolled back
            self.handle_nonfinite(bad)
        synced = {}
        if self.syncer is not None:  # after a rollback too: the engine serves what the trainer holds
            synced = self.syncer.sync(self.step)
        return {**synced, "nonfinite_rollbacks": self.rollbacks}

    def handle_nonfinite(self, bad: str) -> None:
        """`[training] on_nonfinite`: raise ("stop"), or reload the last checkpoint and skip this batch (several
        adapters: only the adapter `bad` belongs to)."""
        k = adapter_of(bad) if self.adapters else None
        owner = "" if k is None else f" (adapter {self.adapters[k].name!r})"
        what = f"step {self.step}: adapter tensor {bad}{owner} holds NaN/Inf after the optimizer step"
        if self.cfg.training.on_nonfinite == "stop":
            raise NonFiniteAdapterError(
                f"{what}; stopped ([training] on_nonfinite = \"stop\"). The checkpoints saved so far are "
                "finite: lower the learning rate or check the data, or set on_nonfinite = \"rollback\""
            )
        if not self.checkpointer.steps():  # preflight refused rollback without [checkpoint] enable
            raise NonFiniteAdapterError(
                f"{what}, and there is no checkpoint to roll back to yet: set [checkpoint] enable = true "
                "with a smaller [checkpoint] interval, or [training] on_nonfinite = \"stop\""
            )
        self.rollbacks += 1
        if k is not None:  # that adapter alone: the others keep this step's update
            restored = self.checkpointer.restore_adapter(k)
            logger.error("%s; rolled that adapter back to the checkpoint of step %d (its tensors and optimizer "
                         "state; the schedule and the other adapters go on) and skipped its batch", what, restored)
            return
        restored = self.checkpointer.load_latest()
        logger.error("%s; rolled back to the checkpoint of step %d (adapter, optimizer, LR) and skipped "
                     "this batch", what, restored)

    def train(self) -> Path | None:
        """Run to `[training] steps`, logging, checkpointing and syncing along the way; export the adapter
        to `[lora] export_dir` (several adapters: `export_dir/<name>` each). Returns where rank 0 wrote it
        (None on the other ranks, or with no export)."""
        last = self.cfg.training.steps
        if self.syncer is not None:
            self.syncer.sync(self.step)  # the engine serves the starting adapter before any rollout
        self.objective.before_training(self.step)
        while self.step < last:
            self.step += 1
            started = time.perf_counter()
            metrics = self.train_step()
            trained = time.perf_counter()
            metrics |= self.check_and_sync()
            synced = time.perf_counter()
            metrics |= self.objective.after_step(self.step)
            step_s = time.perf_counter() - started
            metrics |= {
                # the step's time apart: training (less the wait for samples), the sync, and the rest
                # (evaluation, the engine's share: phase/engine_*)
                "phase/train_s": trained - started - metrics.get("phase/rollout_wait_s", 0.0),
                "phase/sync_s": synced - trained,
                "step_time_s": step_s,
                "lr": self.lr_schedulers.schedulers[0].get_last_lr()[0],
                "memory_mib": peak_memory_mib(self.device),
            }
            for adapter, lr in zip(self.adapters, self.lr_schedulers.schedulers[0].get_last_lr()):
                metrics[f"{adapter.name}/lr"] = lr
            self.metrics.log(self.step, {k if "/" in k else f"train/{k}": v for k, v in metrics.items()})
            self.metrics.progress(self.step, last, self.objective.progress_fields(metrics))
            if self.checkpointer.should_save(self.step, last):
                self.checkpointer.save(self.step, self.objective.data_state())
        if self.cfg.lora.export_dir and self.adapter is not None:  # several adapters: export_dir/<name> each
            return self.adapter.export(self.cfg.lora.export_dir)
        return None

    def close(self) -> None:
        """Stop engines and flush logs."""
        self.objective.close()
        if self.syncer is not None:
            self.syncer.close()
        self.metrics.close()


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


RANK0_FIRST_S = 30.0
"""How long the other ranks wait on a config error before they exit too (torchrun stops them sooner)."""


def let_rank0_fail_first() -> None:
    """A config error on a rank but 0: wait (bounded) so that rank 0, which reports the error, fails first.
    torchrun names the first failure as the root cause and stops the other ranks then; had this rank exited
    at once, it could be named (with no message) or rank 0 could be stopped before writing its error file."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        time.sleep(RANK0_FIRST_S)


def report_config_errors(err: Exception) -> None:
    """One `titan_lora: config error: ...` line per mistake: on stderr, or, when torchrun started this rank,
    in the error file it reads, so that its failure block shows them as the root cause (and only there)."""
    text = "\n".join(f"titan_lora: config error: {line}" for line in str(err).splitlines() or [repr(err)])
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")  # one per rank from torchrun; "" without a log dir
    if error_file:
        # The layout of torch's ErrorHandler.record_exception without "py_callstack": the block prints
        # "message" in place of a traceback, and torchrun's @record can add the exit code to it.
        failure = {"message": {"message": text, "extraInfo": {"timestamp": str(int(time.time()))}}}
        try:
            with open(error_file, "w") as f:
                json.dump(failure, f)
            return
        except OSError:
            pass  # printed is better than lost
    print(text, file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    """Parse the config (failing fast on errors), then train."""
    # SIGTERM (torchrun's, a scheduler's, `kill`) unwinds like Ctrl-C: the engine is stopped and the
    # shared-memory buffers are unlinked, which a default SIGTERM death leaves behind in /dev/shm.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    end_with_launcher()  # a rank must not outlive its torchrun agent (and keep the engine it started)
    rank0 = os.environ.get("RANK", "0") == "0"  # the other ranks would repeat every line; they keep warnings
    logging.basicConfig(
        level=logging.INFO if rank0 else logging.WARNING, format="[titan_lora %(asctime)s] %(message)s",
        datefmt="%H:%M:%S",
    )
    for client_log in ("httpx", "httpx2"):  # the openai client's one line per rollout request (httpx2: openai 2.x)
        logging.getLogger(client_log).setLevel(logging.WARNING)
    try:
        job_config, model = load_job(sys.argv[1:] if argv is None else argv)
        task = check_plugins(job_config)
        check_prompt_lengths(job_config, task, model.hf_dir)
    except (ValueError, FileNotFoundError) as err:
        if rank0:  # every rank read the same config: one copy of the message is enough
            report_config_errors(err)
        else:
            let_rank0_fail_first()
        sys.exit(2)
    logger.info("%s: %s, writing to %s", job_config.job.config_file or "job", job_config.job.description,
                job_config.job.dump_folder)
    run = TrainingRun(job_config, task, model)
    finished, adapter = False, None
    try:
        adapter = run.train()
        finished = True
    finally:
        run.close()
        del run  # its model's DTensors must not outlive the process group (see leave_distributed)
        # Together only when finished: a rank leaving on an error must not wait for peers that never come.
        leave_distributed(together=finished)
    if adapter is not None and len(job_config.adapters) > 1:  # last, after the engine's shutdown: the result
        logger.info("the trained adapters (one PEFT folder each: %s) are in %s",
                    ", ".join(a.name for a in job_config.adapters), adapter.resolve())
    elif adapter is not None:
        logger.info("the trained adapter (PEFT: adapter_config.json, adapter_model.safetensors) is in %s",
                    adapter.resolve())


if __name__ == "__main__":
    main()
