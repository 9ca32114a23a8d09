"""Entry point of `titan-lora serve`: `torchrun -m titan_lora.service.main --job.config_file CONFIG`.

Builds the config's model once with `[service] max_adapters` adapter slots (the trainer a TOML job uses:
`build_model`, the K-adapter LoRA linears, torchtitan's parallelism), serves the Tinker API from a thread
(`routes`), and runs the calls on the main thread (`worker`) until stopped (SIGTERM or Ctrl-C).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist
import uvicorn

from titan_lora.compose import adapter_source, build_sync, engine_side
from titan_lora.config import JobConfig
from titan_lora.config_adapters import Adapter
from titan_lora.models.resolve import ResolvedModel
from titan_lora.service.futures import FutureStore
from titan_lora.service.ledger import Ledger
from titan_lora.service.rounds import DroppedFutures, Round, mirror, rank0_round, share_round
from titan_lora.service.routes import Api, ServedModel
from titan_lora.service.sampling import Publisher, Sampling
from titan_lora.service.slots import AdapterSlots
from titan_lora.service.step import Limits
from titan_lora.service.worker import Worker
from titan_lora.sync.syncer import WeightSyncer
from titan_lora.titan.parallel import DataParallelInfo, build_parallel_dims, data_parallel_info
from titan_lora.trainer.build import BuiltModel, build_model
from titan_lora.trainer.distributed import device_for_rank, init_distributed, leave_distributed
from titan_lora.trainer.job_config import load_job

logger = logging.getLogger("titan_lora")

ENV_KEYS = "TITAN_LORA_API_KEYS"
"""Comma-separated API keys let in besides `[service] api_keys`."""


def api_keys(job_config: JobConfig) -> set[str]:
    """The keys let in: `[service] api_keys` and $TITAN_LORA_API_KEYS."""
    extra = [k.strip() for k in os.environ.get(ENV_KEYS, "").split(",") if k.strip()]
    return set(job_config.service.api_keys) | set(extra)


def service_errors(job_config: JobConfig) -> list[str]:
    """What `titan-lora serve` refuses in a config that training would accept, one line each."""
    errors = []
    keys = api_keys(job_config)
    if not keys:
        errors.append(f"[service] api_keys is empty: set at least one key (\"tml-...\"), or export {ENV_KEYS}")
    errors += [f"[service] api_keys: {k[:8]}... must start with \"tml-\" (the tinker SDK refuses other keys)"
               for k in sorted(keys) if not k.startswith("tml-")]
    if "lora" not in job_config.model.converters:
        errors.append('[model] converters must include "lora": the service trains LoRA adapters')
    if job_config.adapters:
        errors.append("[[adapters]] tables are for training jobs; the service makes [service] max_adapters "
                      "slots itself: remove the tables")
    return errors


def slot_adapters(job_config: JobConfig) -> list[Adapter]:
    """The adapter slots the service's model is built with: `max_adapters` of `max_rank` on [lora]'s targets."""
    svc = job_config.service
    return [Adapter(name=f"slot{k}", rank=svc.max_rank, alpha=svc.lora_alpha) for k in range(svc.max_adapters)]


def service_job(job_config: JobConfig, world_size: int = 1) -> JobConfig:
    """The config as the service builds it: `[service] max_adapters` adapter tables (`slot_adapters`); on
    several ranks the adapters sharded by FSDP (a client's forward_backward calls accumulate gradients over
    several backwards until its optim_step, which replicated adapters refuse)."""
    lora = job_config.lora
    if world_size > 1 and lora.replicate_adapters:
        logger.info("[lora] replicate_adapters = true is set false on %d ranks: a client's forward_backward calls "
                    "accumulate gradients until its optim_step, which FSDP-sharded adapters do", world_size)
        lora = dataclasses.replace(lora, replicate_adapters=False)
    return dataclasses.replace(job_config, adapters=slot_adapters(job_config), lora=lora)


def build_slots(job_config: JobConfig, resolved: ResolvedModel,
                device: torch.device) -> tuple[BuiltModel, AdapterSlots, DataParallelInfo]:
    """Collective: the model of `service_job(job_config)` on this process group's ranks, the slots over it, and
    its data-parallel ranks (which split a mixed step's rows)."""
    dims = build_parallel_dims(job_config.parallelism, dist.get_world_size(), device)
    built = build_model(job_config, dims, device, resolved)
    return built, AdapterSlots(built.model, job_config.service.lora_alpha), data_parallel_info(dims)


@dataclasses.dataclass
class Service:
    """Every part of a running service, built once (`build_service`)."""

    job_config: JobConfig
    ledger: Ledger
    futures: FutureStore
    worker: Worker
    api: Api | None  # rank 0's; None on the other ranks
    syncer: WeightSyncer | None
    device: torch.device

    def close(self) -> None:
        """Stop the engine (if the service started one)."""
        if self.syncer is not None:
            self.syncer.close()


def build_service(job_config: JobConfig, resolved: ResolvedModel, device: torch.device) -> Service:
    """Collective: the model with its slots; with `[weight_sync] enabled`, the engine, the syncer over every
    slot and sampling; the ledger, the worker and the API."""
    job_config, svc = service_job(job_config, dist.get_world_size()), job_config.service
    built, slots, data_parallel = build_slots(job_config, resolved, device)
    lead = dist.get_rank() == 0  # serves the API and the engine; the other ranks follow its rounds
    limits = Limits(resolved.shape.vocab_size, min(resolved.shape.max_seq_len, job_config.training.seq_len),
                    svc.max_request_tokens, svc.micro_batch_tokens)
    served = ServedModel(svc.base_model or Path(built.hf_dir).name, built.hf_dir, svc.max_rank, limits.max_seq_len,
                         svc.max_queued)
    ledger = Ledger(slots.count, svc.session_timeout_s, svc.max_adapters_per_key)
    futures = FutureStore() if lead else DroppedFutures()
    syncer, sampling, publisher = None, None, None
    if job_config.weight_sync.enabled:
        side = engine_side(job_config, built, device)
        try:
            source = adapter_source(job_config, built, side)
            # A sampling client may sample an older version for as long as it lives, and never says it is
            # gone: the engine keeps each client's versions last published or sampled.
            syncer, _ = build_sync(job_config, source, built, device, side, None, recently_used=True)
        except BaseException:
            side.stop()
            raise
        if lead:
            sampling = Sampling(syncer.families, side.rollouts, futures, served.name, limits.vocab_size)
        publisher = Publisher(syncer, source, sampling)
        publisher.start()
    worker = Worker(built.model, slots, limits, device, str(Path(job_config.job.dump_folder) / svc.state_dir),
                    ledger, futures, publisher, data_parallel.group)
    api = Api(served, api_keys(job_config), ledger, futures, sampling) if lead else None
    return Service(job_config, ledger, futures, worker, api, syncer, device)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> None:
    """Build the model, serve the API, run calls until stopped."""
    signal.signal(signal.SIGTERM, _exit_on_signal)
    lead = int(os.environ.get("RANK", "0")) == 0  # the other ranks' lines would repeat rank 0's
    logging.basicConfig(level=logging.INFO if lead else logging.WARNING, format="[titan_lora %(asctime)s] %(message)s",
                        datefmt="%H:%M:%S")
    for client_log in ("httpx", "httpx2"):  # the openai client's one line per engine request
        logging.getLogger(client_log).setLevel(logging.WARNING)
    job_config, resolved = load_job(sys.argv[1:] if argv is None else argv)
    errors = service_errors(job_config)
    if errors:
        for line in errors:
            print(f"titan_lora: config error: {line}", file=sys.stderr)
        sys.exit(2)
    device = device_for_rank()
    init_distributed(device)
    service = None
    try:
        service = build_service(job_config, resolved, device)
        if service.api is not None:
            serve(service)
        else:
            follow(service)
    finally:
        if service is not None:
            service.close()
        leave_distributed(together=False)


def serve(service: Service) -> None:
    """Run the API in a thread and the worker here until SIGTERM/SIGINT."""
    job_config, api, ledger = service.job_config, service.api, service.ledger
    assert api is not None, "serve runs on rank 0; the other ranks follow()"
    server = uvicorn.Server(uvicorn.Config(api.app(), host=job_config.service.host, port=job_config.service.port,
                                           log_level="warning", timeout_keep_alive=75))
    thread = threading.Thread(target=server.run, name="tinker-api", daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        thread.join(0.05)
    if not thread.is_alive():
        raise RuntimeError(f"the API could not listen on {job_config.service.host}:{job_config.service.port}; "
                           "pick another [service] port")
    port = server.servers[0].sockets[0].getsockname()[1]
    svc = job_config.service
    logger.info("serving the Tinker API for %s on http://%s:%d (%d adapter slots of rank <= %d, sampling %s); "
                "point the SDK at it: TINKER_BASE_URL=http://%s:%d", api.served.name, svc.host, port,
                svc.max_adapters, svc.max_rank, "on" if api.sampling else "off", svc.host, port)
    several = dist.get_world_size() > 1
    try:
        while thread.is_alive():
            ops = ledger.take(1.0)
            if several:  # every second, calls or none: the other ranks wait in this broadcast
                share_round(rank0_round(ledger, ops), service.device)
            if ops:
                service.worker.run(ops)
        if several:
            share_round(Round([], {}, stop=True), service.device)
    finally:
        ledger.close()
        server.should_exit = True
        thread.join(10)


def follow(service: Service) -> None:
    """A rank other than 0: run the rounds rank 0 shares until it stops."""
    while not (round_ := share_round(None, service.device)).stop:
        mirror(service.ledger, round_)
        if round_.ops:
            service.worker.run(round_.ops)


if __name__ == "__main__":
    main()
