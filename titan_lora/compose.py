"""The composition root: every part of a job that talks to the engine (the adapter source included), built
once from its own config section and handed explicit arguments. Nothing below receives the run, and no
config is rewritten: runtime facts (the embedded engine's address and key) travel as an `Endpoint`."""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from titan_lora.clients.base import Emitter, Endpoint
from titan_lora.clients.kinds import EngineKind, LaunchRequest, engine_kind
from titan_lora.clients.fanout import FanoutEmitter
from titan_lora.clients.http import ApiKey
from titan_lora.clients.launch import EmbeddedEngine, start_engines
from titan_lora.clients.replica_set import Replica, ReplicaSet
from titan_lora.clients.rollout import RolloutClient
from titan_lora.clients.router import RolloutRouter
from titan_lora.config import GRPO, Engine, JobConfig, WeightSync, attached_urls
from titan_lora.config_adapters import adapter_lora, adapter_section, job_adapters
from titan_lora.rl.agent_objective import AgentObjective, check_agent_config
from titan_lora.rl.agent_task import is_agent_task
from titan_lora.rl.multi_objective import MultiGRPOObjective
from titan_lora.rl.objective import GRPOObjective
from titan_lora.rl.rewards import get_reward
from titan_lora.rl.sample_source import sample_source
from titan_lora.export.peft import PeftLayout
from titan_lora.rl.task import Task, build_task, task_prompt
from titan_lora.sync.adapter_set import AdapterSetSource
from titan_lora.sync.adapter_source import AdapterSource
from titan_lora.sync.base_digest import base_digests
from titan_lora.sync.base_stream import base_weights_source
from titan_lora.sync.engine_access import EngineRollouts
from titan_lora.sync.gather import Lend
from titan_lora.sync.parity import ParityProbe
from titan_lora.sync.syncer import WeightSyncer
from titan_lora.sync.versions import AdapterVersions
from titan_lora.sync.watchdog import Watchdog
from titan_lora.titan.parallel import DataParallelInfo, ParallelDims, data_parallel_info
from titan_lora.trainer.build import BuiltModel
from titan_lora.trainer.metrics import MetricsLogger
from titan_lora.trainer.objective import Objective
from titan_lora.trainer.sft import SFTObjective
from titan_lora.trainer.sft_data import SFTData, global_batch_size
from titan_lora.transfer.placement import choose_transport
from titan_lora.transfer.transport import plain_buffer


PROBE_SEED = 4242


def probe_sequences(tokenizer, n: int = 4, task: Task | None = None) -> list[list[int]]:  # noqa: ANN001
    """A fixed batch of the task's chat-formatted prompts with their answers, as token ids (the default
    `[grpo] task` when none is given)."""
    task = task if task is not None else build_task(GRPO())
    seqs = []
    for p in task.problems(n, seed=PROBE_SEED):
        text = task_prompt(tokenizer, task, p.question, p.system) + str(p.answer) + tokenizer.eos_token
        seqs.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return seqs


def embedded_engine(kind: EngineKind, engine: Engine, ws: WeightSync, hf_dir: str, device: torch.device,
                    dump_folder: str, lora_rank: int, log_name: str = "engine.log", adapters: int = 1,
                    ) -> EmbeddedEngine:
    """The engine process titan_lora starts itself, as its kind's launcher plans it (`lora_rank`: the largest
    of the job's `adapters`).

    Its API key is `[engine] api_key`, or a random one; it reaches the engine by environment."""
    plan = kind.launch(LaunchRequest(engine, ws.keep_versions, hf_dir, device, lora_rank,
                                     base_digests=ws.base == "verify", adapters=adapters))
    return EmbeddedEngine(plan, engine.port, os.path.join(dump_folder, log_name),
                          start_timeout_s=ws.engine_start_timeout_s, api_key=engine.api_key,
                          health_timeout_s=ws.health_timeout_s)


@dataclasses.dataclass
class EngineSide:
    """Rank 0's handles on the engine: the process (when embedded), the emitter and the rollout client.
    With several replicas: the replica set, the fan-out emitter and the router (no single process)."""

    engine: EmbeddedEngine | None = None
    emitter: Emitter | None = None
    rollouts: RolloutClient | None = None
    replicas: ReplicaSet | None = None

    def on_wedge(self, reason: str) -> None:
        """End every request in flight on a wedged engine now: an embedded one is killed (the syncer's
        recovery restarts it), an attached one's requests are interrupted (the recovery waits for it)."""
        if self.engine is not None:
            self.engine.kill()
            return
        self.emitter.interrupt(reason)
        if self.rollouts is not None:
            self.rollouts.interrupt(reason)

    def watchdog(self, ws: WeightSync) -> Watchdog | None:
        """Rank 0's watch over one engine while operations wait on it (None for replicas, which the replica
        set watches one by one, and on the other ranks)."""
        if self.emitter is None or self.replicas is not None:
            return None
        return Watchdog(self.emitter.check_live, self.on_wedge, ws.health_timeout_s)

    def stop(self) -> None:
        """Stop what this job started (after a failed start-up: nothing may be left behind)."""
        if self.engine is not None:
            self.engine.stop()
        if self.replicas is not None:
            self.replicas.close()

    @property
    def lend(self) -> Lend:
        """Where rank 0's gather writes the adapter: the emitter's transport buffer, else plain memory."""
        return self.emitter.lend_buffer if self.emitter is not None else plain_buffer


def engine_endpoint(kind: EngineKind, engine: Engine, url: str, api_key: ApiKey | str) -> Endpoint:
    """The engine at `url`, and for a kind that sends buckets the transport they take: `[engine]
    transport`, where "auto" decides from where the engine is (`transfer/placement.py`)."""
    if not kind.shm_buckets:
        return Endpoint(url, api_key)
    return Endpoint(url, api_key, choose_transport(engine.transport, url, engine.tcp_host, engine.tcp_port,
                                                  engine.nccl_backend))


def connect_replicas(kind: EngineKind, engine: Engine, ws: WeightSync, hf_dir: str, device: torch.device,
                     dump_folder: str, lora_rank: int, adapters: int = 1) -> EngineSide:
    """Rank 0: start `[engine] replicas` engines at once (each its own port and log) or attach to `urls`;
    one emitter and rollout client per replica, under the fan-out emitter and the router."""
    urls = attached_urls(engine)
    processes: list[EmbeddedEngine | None] = [None] * len(urls)
    keys = [engine.api_key] * len(urls)
    if not urls:
        processes = [embedded_engine(kind, dataclasses.replace(engine, port=engine.port + i if engine.port else 0),
                                     ws, hf_dir, device, dump_folder, lora_rank, log_name=f"engine{i}.log",
                                     adapters=adapters)
                     for i in range(engine.replicas)]
        start_engines(processes)
        urls, keys = [p.url for p in processes], [p.key for p in processes]
    replicas = []
    for i, (url, key, process) in enumerate(zip(urls, keys, processes)):
        endpoint = engine_endpoint(kind, engine, url, key)
        rollouts = kind.rollouts(endpoint, ws) if kind.rollouts else None
        replicas.append(Replica(i, endpoint, kind.emitter(ws, engine, endpoint), rollouts, process))
    replica_set = ReplicaSet(replicas, ws)
    router = RolloutRouter(replica_set) if kind.rollouts else None
    return EngineSide(None, FanoutEmitter(replica_set), router, replica_set)


def connect_engine(engine: Engine, ws: WeightSync, hf_dir: str, device: torch.device, dump_folder: str,
                   lora_rank: int, adapters: int = 1) -> EngineSide:
    """Rank 0: start the engine (no `[engine] url`) or attach; the emitter and rollout client. Several
    replicas (`[engine] replicas` > 1, or more than one of `urls`) go through `connect_replicas`."""
    kind = engine_kind(engine.kind)
    if engine.replicas > 1 or len(engine.urls) > 1:
        return connect_replicas(kind, engine, ws, hf_dir, device, dump_folder, lora_rank, adapters)
    engine = dataclasses.replace(engine, url=(attached_urls(engine) or [""])[0], urls=[])
    process = None
    url, api_key = engine.url, engine.api_key
    if not engine.url:
        process = embedded_engine(kind, engine, ws, hf_dir, device, dump_folder, lora_rank, adapters=adapters)
        process.start()
        url, api_key = process.url, process.key
    endpoint = engine_endpoint(kind, engine, url, api_key)
    rollouts = kind.rollouts(endpoint, ws) if kind.rollouts else None
    return EngineSide(process, kind.emitter(ws, engine, endpoint), rollouts)


def build_syncer(ws: WeightSync, side: EngineSide, adapter: AdapterSource | AdapterSetSource, model: nn.Module,
                 sd_adapter, hf_dir: str, tied: bool, device: torch.device,  # noqa: ANN001
                 probe_task: Task | None = None, layout: PeftLayout | None = None,
                 recently_used: bool = False) -> WeightSyncer:
    """Collective: the syncer over `side` (rank 0's handles; empty elsewhere), engine limits checked.

    `tied`: the model's output head is the embedding (`BuiltModel.tied`), so the base stream leaves
    lm_head out. The parity probe scores `probe_task`'s prompts (the default task when None). `layout`: the
    family's RoPE rows, which the base's digests need ([weight_sync] base = "verify"; None: pushed).
    `recently_used`: the engine keeps the versions last published or sampled, not the newest."""
    from transformers import AutoTokenizer

    probe = None
    if ws.parity_every:
        sequences = probe_sequences(AutoTokenizer.from_pretrained(hf_dir), task=probe_task)
        probe = ParityProbe(model, sequences, device, side.rollouts.score if side.rollouts else None, ws.parity_tolerance)
    names = adapter.names if isinstance(adapter, AdapterSetSource) else [ws.lora_name]
    families = [AdapterVersions(name, ws.keep_versions, recently_used) for name in names]  # one per adapter
    versions = families[0] if len(families) == 1 else families
    report = side.replicas.metrics if side.replicas is not None else None
    digests = (functools.partial(base_digests, model, sd_adapter, layout, tied)
               if ws.base == "verify" and layout is not None else None)
    syncer = WeightSyncer(adapter, base_weights_source(model, sd_adapter, tied), side.emitter, ws, device,
                          versions=versions, engine=side.engine, probe=probe, report=report,
                          watchdog=side.watchdog(ws), base_digests=digests)
    syncer.check_engine()
    return syncer


def engine_side(job_config: JobConfig, built: BuiltModel, device: torch.device) -> EngineSide:
    """Rank 0 starts or attaches the engine when `[weight_sync] enabled`; other ranks hold no handle."""
    if not job_config.weight_sync.enabled or dist.get_rank() != 0:
        return EngineSide()
    count = max(len(job_config.adapters), 1)  # several: slots and the largest rank for all of them
    rank = max(a.rank for a in job_adapters(job_config)) if count > 1 else job_config.lora.rank
    return connect_engine(job_config.engine, job_config.weight_sync, built.hf_dir, device,
                          job_config.job.dump_folder, rank, count)


def adapter_source(job_config: JobConfig, built: BuiltModel, side: EngineSide,
                   ) -> AdapterSource | AdapterSetSource | None:
    """Collective: the adapter (several `[[adapters]]`: all of them, one family each) as rank 0 publishes and
    exports it, gathered into the buffer `side`'s emitter lends; None for full fine-tuning (no "lora"
    converter: nothing to gather)."""
    if "lora" not in job_config.model.converters:
        return None
    if len(job_config.adapters) > 1:
        adapters = [(a.name, adapter_lora(a, job_config.lora)) for a in job_adapters(job_config)]
        return AdapterSetSource(built.model, built.peft_layout, adapters, built.hf_dir, lend=side.lend)
    return AdapterSource(built.model, built.peft_layout, job_config.lora, job_config.weight_sync.lora_name,
                         built.hf_dir, lend=side.lend)


def build_sync(job_config: JobConfig, adapter: AdapterSource | AdapterSetSource, built: BuiltModel, device: torch.device,
               side: EngineSide, task: Task | None, recently_used: bool = False) -> tuple[WeightSyncer, EngineRollouts]:
    """Collective: the syncer over `side` (from `engine_side`), and what objectives may use.

    `task` is what `check_plugins` built: the parity probe scores its prompts. `recently_used`: retention
    keeps the versions last published or sampled (a service's sampling clients), not the newest."""
    syncer = build_syncer(job_config.weight_sync, side, adapter, built.model, built.sd_adapter, built.hf_dir,
                          built.tied, device, task, built.peft_layout, recently_used)
    return syncer, EngineRollouts(side.rollouts, syncer.versions, syncer.with_engine, tuple(syncer.families))


def configured_task(job_config: JobConfig) -> Task:
    """The task `[grpo] task` names, built from its `[task]` section."""
    return build_task(job_config.grpo, job_config.task)


def task_in_use(job_config: JobConfig) -> bool:
    """Whether the job uses `[grpo] task`: GRPO trains on it, or the parity probe scores its prompts."""
    ws = job_config.weight_sync
    return job_config.grpo.enabled or (ws.enabled and bool(ws.parity_every))


def check_adapter_tasks(job_config: JobConfig) -> None:
    """Resolve every `[[adapters]]` table's task and reward as `check_plugins` does `[grpo]`'s; an agent task
    (several turns per sample) is refused: several adapters train tasks of one completion so far."""
    for adapter in job_adapters(job_config):
        grpo = adapter_section(adapter, "grpo", job_config.grpo)
        task = build_task(grpo, job_config.task)
        task.problems(1, 0)
        if is_agent_task(task):
            raise ValueError(f"[[adapters]] {adapter.name!r}: task = {grpo.task!r} runs agent episodes, which "
                             "several adapters do not train yet: set a task of one completion, or keep one table")
        if grpo.reward:
            get_reward(grpo.reward)


def check_plugins(job_config: JobConfig) -> Task | None:
    """Resolve the `[grpo]` task and reward by name, and let the task check `[task]`, before anything is
    built (a typo or a bad data file fails in seconds).

    Returns the task, built once here for the objective and the parity probe; None when neither uses it."""
    if not task_in_use(job_config):
        return None
    if job_config.grpo.enabled and len(job_config.adapters) > 1:
        check_adapter_tasks(job_config)
    task = configured_task(job_config)
    task.problems(1, 0)
    if job_config.grpo.enabled and is_agent_task(task):
        check_agent_config(job_config.grpo)
    if job_config.grpo.enabled and job_config.grpo.reward:
        get_reward(job_config.grpo.reward)
    return task


def multi_grpo_objective(job_config: JobConfig, tokenizer, engine: EngineRollouts | None,  # noqa: ANN001
                         dp: DataParallelInfo, device: torch.device, metrics: MetricsLogger,
                         data_state: dict | None = None) -> MultiGRPOObjective:
    """GRPO on every `[[adapters]]` table: each its own `[grpo]` keys (task, reward, seed, temperature, ...),
    its family of versions, its record (`rollouts_<name>.jsonl`) and its loop resumed at its own data position
    (`data_state`, by adapter name), trained in one step, in one forward or one per adapter (`[grpo]
    adapter_batches`)."""
    objectives, names = [], []
    for k, adapter in enumerate(job_adapters(job_config)):
        grpo = adapter_section(adapter, "grpo", job_config.grpo)
        record = os.path.join(job_config.job.dump_folder, f"rollouts_{adapter.name}.jsonl")
        own = engine.of_adapter(k) if engine is not None else None
        objectives.append(GRPOObjective(grpo, build_task(grpo, job_config.task), tokenizer, own, dp, device,
                                        metrics.prefixed(f"{adapter.name}/"),
                                        sample_source(grpo, (data_state or {}).get(adapter.name)), record,
                                        adapter.name))
        names.append(adapter.name)
    each = job_config.grpo.adapter_batches == "each" or (job_config.grpo.adapter_batches == "auto"
                                                         and device.type == "cpu")
    return MultiGRPOObjective(objectives, names, engine, backward_each=each)


def build_objective(job_config: JobConfig, hf_dir: str, dims: ParallelDims, device: torch.device, metrics: MetricsLogger,
                    engine: EngineRollouts | None, task: Task | None, data_state: dict | None = None) -> Objective:
    """The objective the job config asks for: GRPO (`[grpo] enabled`) on `task` (from `check_plugins`),
    else SFT. `data_state`: what the resumed checkpoint kept of the data position."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    dp = data_parallel_info(dims)
    if job_config.grpo.enabled and len(job_config.adapters) > 1:
        return multi_grpo_objective(job_config, tokenizer, engine, dp, device, metrics, data_state)
    if job_config.grpo.enabled:
        loop = sample_source(job_config.grpo, data_state)  # the one place `[grpo] loop` is read
        record = os.path.join(job_config.job.dump_folder, "rollouts.jsonl")
        if is_agent_task(task):
            return AgentObjective(job_config.grpo, task, tokenizer, engine, dp, device, metrics,
                                  job_config.training.seq_len, loop, record)
        return GRPOObjective(job_config.grpo, task, tokenizer, engine, dp, device, metrics, loop, record)
    batch = global_batch_size(job_config.training, dp.size)
    if len(job_config.adapters) > 1:  # each adapter its own data, the same batch size
        adapters = job_adapters(job_config)
        data = [SFTData(tokenizer, a.data_path, job_config.training.seq_len, batch, a.data_seed) for a in adapters]
        return SFTObjective(data, dp, device, [a.name for a in adapters])
    data = SFTData(tokenizer, job_config.data.path, job_config.training.seq_len, batch, job_config.data.seed)
    return SFTObjective(data, dp, device)
