"""The vLLM engine as vLLM's own OpenAI-compatible server, with titan_lora's transfer routes inside.

    python -m titan_lora.engines.vllm_openai MODEL [any `vllm serve` flag]

It is `vllm serve` (its argument parser, API server, AsyncLLM and engine processes), with defaults of
its own: LoRA on, chunked prefill off on CPU (see `parse_args`), titan_lora's worker extension
(adapters arrive in memory through `collective_rpc`) and the middleware `titan_asgi.TitanRoutes` (the `/titan/*` routes, the alias of
each adapter to its newest version, and a lease per request). `/v1/*` serves the base and every live
adapter version (`model="<lora_name>-v<step>"`, or `model="<lora_name>"` for the newest).

Secrets come by environment, never argv (`ps` shows argv): TITAN_LORA_API_KEY becomes vLLM's
`--api-key`, which then guards `/v1/*` and `/titan/*` alike; TITAN_LORA_ENGINE_NONCE is echoed by
`/titan/info`. The fault-injection variables of `titan_lora.engines.transfers` apply as well, and the
episode bounds of `titan_lora.engines.episode_store`.
`--titan-skip-base-digests` (passed by the launcher under `[weight_sync] base = "push"`) spares each worker
digesting the checkpoint as it loads (`titan_lora.engines.base_record`).

It refuses to start, before vLLM parses its flags or loads a model, on a vLLM release titan_lora was not
tested with, unless TITAN_LORA_ALLOW_UNTESTED_VLLM=1 (`titan_lora.transfer.vllm_release`).
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping, MutableMapping

from titan_lora.engines import base_record
from titan_lora.engines import vllm_compat as compat
from titan_lora.engines.episode_store import EpisodeLimits
from titan_lora.engines.lifetime import children_die_with_this_process, forked_children_close_port
from titan_lora.transfer import protocol

# vLLM spawns (or, on CPU, this module forks) its engine core and workers: each of them dies with the
# process that started it (vLLM's engine core does not watch its API server). A spawned child imports
# this module first.
children_die_with_this_process()

EXTENSION = "titan_lora.engines.vllm_ext.TitanLoRAWorkerExtension"
MIDDLEWARE = "titan_lora.engines.titan_asgi.TitanRoutes"
IN_CORE_WORKER_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
SPAWN_CORE_ENV = "TITAN_LORA_SPAWN_ENGINE_CORE"
KEEP_ALIVE_ENV = "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"
KEEP_ALIVE_S = 30
"""How long the server keeps an idle connection: longer than clients keep theirs (httpx, under the `openai`
package, keeps them 5 s: exactly vLLM's default, so a client could reuse one the server closes that moment)."""


def data_parallel_refusal(args: argparse.Namespace) -> str | None:
    """Why these data-parallel flags cannot serve titan_lora's syncs, or None when they can.

    With `--data-parallel-size N` alone (the internal load balancer) the one API server manages every
    engine core and `vllm_compat.collective_rpc_all` reaches each. With an external, hybrid or
    multi-port load balancer each API server manages only its own node's (or rank's) cores, so a sync
    through one server would leave the other ranks on their old adapter.
    """
    modes = [flag for flag, on in (
        ("--data-parallel-external-lb", args.data_parallel_external_lb),
        ("--data-parallel-rank", args.data_parallel_rank is not None),
        ("--data-parallel-hybrid-lb", args.data_parallel_hybrid_lb),
        ("--data-parallel-start-rank", args.data_parallel_start_rank is not None),
        ("--data-parallel-multi-port-external-lb", args.data_parallel_multi_port_external_lb),
    ) if on]
    if not modes:
        return None
    return (f"{', '.join(modes)}: each API server then reaches only its own data-parallel ranks, and a sync "
            "through one of them would leave the others on their old adapter. Use --data-parallel-size N "
            "alone (one API server, vLLM's internal load balancer: every rank gets each adapter), or run "
            "independent engines, one URL each")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """`vllm serve`'s options, with LoRA, titan_lora's worker extension and middleware, and the key
    from TITAN_LORA_API_KEY."""
    parser = compat.serve_parser(__doc__.split("\n\n")[0])
    parser.set_defaults(enable_lora=True, worker_extension_cls=EXTENSION)
    parser.add_argument(protocol.SKIP_BASE_DIGESTS_FLAG, dest="titan_skip_base_digests", action="store_true",
                        help="titan_lora: record no digest of the base the workers load (a trainer with "
                             '[weight_sync] base = "push" never asks for them)')
    if compat.is_cpu():
        # After a partial (chunked) prefill vLLM rewinds a seeded request's generator, which a CPU
        # generator cannot do: the engine dies ("CPU Generator does not use offset", vLLM 0.32).
        parser.set_defaults(enable_chunked_prefill=False)
    args = parser.parse_args(argv)
    if args.model_tag is not None:
        args.model = args.model_tag
    if args.api_server_count not in (None, 1):
        raise SystemExit(f"--api-server-count {args.api_server_count}: titan_lora's adapter table and leases "
                         "live in one API server process; leave it at 1 (vLLM still runs every "
                         "--data-parallel-size engine behind it)")
    args.api_server_count = 1
    refusal = data_parallel_refusal(args)
    if refusal is not None:
        raise SystemExit(refusal)
    if not args.enable_lora:
        raise SystemExit("titan_lora serves adapters: drop --no-enable-lora")
    if MIDDLEWARE not in args.middleware:
        args.middleware = [*args.middleware, MIDDLEWARE]
    key = os.environ.get(protocol.API_KEY_ENV)
    if key:
        args.api_key = [key]
    return args


def keep_cpu_worker_in_engine_core(args: argparse.Namespace, env: MutableMapping[str, str]) -> None:
    """On CPU with one worker, run it inside the engine-core process (unless `env` already says), as vLLM
    runs a single GPU's worker: vLLM's CPU backend would otherwise start a third process that imports
    vLLM again, about 8 s of every engine start. It forgoes vLLM's OpenMP core binding for that worker;
    VLLM_ENABLE_V1_MULTIPROCESSING=1 keeps vLLM's own layout."""
    if compat.is_cpu() and args.tensor_parallel_size * args.pipeline_parallel_size == 1:
        env.setdefault(IN_CORE_WORKER_ENV, "0")


def fork_cpu_engine_cores(env: Mapping[str, str]) -> bool:
    """On CPU, start vLLM's engine cores by fork from this API server, which has imported vLLM already
    (spawned, each imports it again: 14-19 s of a 30-45 s start on 2 cores, and of every recovery); True
    when set. vLLM's CPU platform asks for spawn, for workers that bind OpenMP threads to NUMA nodes, which
    the one in-core worker does not do. TITAN_LORA_SPAWN_ENGINE_CORE=1 keeps vLLM's spawn."""
    if not compat.is_cpu() or env.get(SPAWN_CORE_ENV) == "1":
        return False
    compat.fork_engine_cores()
    return True


def keep_idle_connections_longer_than_clients(env: MutableMapping[str, str]) -> None:
    """Set vLLM's HTTP keep-alive to KEEP_ALIVE_S unless `env` already says: a client then always drops an idle
    connection before the server does, and never gets "Connection error." from reusing one being closed."""
    env.setdefault(KEEP_ALIVE_ENV, str(KEEP_ALIVE_S))


def skip_base_digests(args: argparse.Namespace, env: MutableMapping[str, str]) -> None:
    """Tell the workers (started after this, with `env`) to record no base digests when `args` say so: a
    spawned one reads `env` as it imports base_record, a forked one inherits this process's reading."""
    if args.titan_skip_base_digests:
        env[base_record.SKIP_ENV] = "1"
        base_record.RECORDING = False


def _log_titan_lines() -> None:
    """Print titan_lora's own INFO lines in the API server (vLLM configures only its `vllm` logger, so
    they would be dropped: e.g. how many trainer mappings were released at shutdown)."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[titan_lora engine %(asctime)s] %(message)s", "%H:%M:%S"))
    log = logging.getLogger("titan_lora")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def main(argv: list[str] | None = None) -> None:
    """Serve until SIGTERM (or Ctrl-C); every worker unmaps the trainer's buffers on the way out."""
    refusal = compat.version_refusal()
    if refusal is not None:
        raise SystemExit(refusal)
    try:
        EpisodeLimits.from_env(os.environ)  # refused now, not at the first request that needs them
    except ValueError as err:
        raise SystemExit(str(err)) from None
    _log_titan_lines()
    args = parse_args(argv)
    keep_cpu_worker_in_engine_core(args, os.environ)  # read by the engine core vLLM starts
    if fork_cpu_engine_cores(os.environ):
        forked_children_close_port(args.port)
    skip_base_digests(args, os.environ)  # read by each worker as it imports the extension
    keep_idle_connections_longer_than_clients(os.environ)  # read as the API server starts
    compat.serve(args)


if __name__ == "__main__":
    main()
