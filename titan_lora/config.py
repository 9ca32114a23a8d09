"""titan_lora's own TOML sections, and `JobConfig`: every section, these and the run's (`run_sections`).

Each dataclass is one TOML section. `validate_*` functions run before any model is built, so a bad
config fails in seconds with a message that names the key and the fix.
"""

import os
import tempfile
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from titan_lora.config_adapters import Adapter
from titan_lora.config_ranges import ConfigError, raise_range_errors  # noqa: F401 (ConfigError: re-exported)
from titan_lora.run_sections import (
    ActivationCheckpoint,
    Checkpoint,
    Compile,
    Debug,
    Job,
    LRScheduler,
    Model,
    Optimizer,
    Parallelism,
    Training,
)

ADAPTER_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class LoRA:
    """`[lora]`: the adapter applied by the `lora` model converter."""

    rank: int = 16
    """The adapter's rank r: lora_A is r x in, lora_B is out x r."""
    alpha: float = 32.0
    """The adapter's output is scaled by alpha / rank (alpha / sqrt(rank) with use_rslora)."""
    use_rslora: bool = False
    """Scale by alpha / sqrt(rank) instead of alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training; 0: none."""
    target_modules: list[str] | str = "all-linear"
    """Leaf names of the linears to adapt (e.g. ["wq", "wv"] or HF names ["q_proj"]), or "all-linear"."""
    dtype: str = "float32"
    """Dtype of lora_A / lora_B: float32, bfloat16 or float16."""
    replicate_adapters: bool = True
    """Keep the adapters whole on every data-parallel rank, outside FSDP, their gradients summed in one
    all-reduce per step: less host work per step than sharding 2 params more per linear."""
    export_dir: str = "adapter"
    """Where the run writes its PEFT adapter (adapter_config.json, adapter_model.safetensors) at the end of
    training; a relative path is under `[job] dump_folder`, as `[checkpoint] folder` is; "": no export."""


@dataclass
class Data:
    """`[data]`: the supervised data for the SFT smoke job."""

    path: str = "titan_lora/data/arith_sft.jsonl"
    """JSONL with {"prompt", "completion"} per line."""
    seed: int = 0
    """Seed of the order the examples are drawn in."""


@dataclass
class Engine:
    """`[engine]`: the inference engine that serves the adapter: its kind, where it is, how it starts."""

    kind: str = "vllm"
    """A registered engine kind: vllm, vllm-disk (vLLM loading PEFT directories: the baseline),
    sglang, receiver (no inference: timing only), or `package.module:KIND` for a plug-in."""
    url: str = ""
    """Attach to a running engine at this address; empty: titan_lora starts one (kinds that can)."""
    port: int = 0
    """Port of the engine titan_lora starts; 0: any free port."""
    api_key: str = ""
    """The engine's API key; empty with a started engine: a random one."""
    admin_api_key: str = ""
    """SGLang only: its --admin-api-key, sent on its weight, LoRA, pause, flush and memory routes only."""
    max_model_len: int = 512
    """vLLM started by titan_lora: --max-model-len."""
    kv_cache_gib: int = 2
    """vLLM started by titan_lora: KV-cache size in GiB."""
    cpu_threads: int = 0
    """vLLM started by titan_lora on CPU: its torch threads (OMP_NUM_THREADS); 0: the cores this process may
    use, shared among the replicas it starts. (torchrun gives each rank 1, which the engine would inherit.)"""
    pause_mode: str = "none"
    """SGLang only: none | abort | retract | in_place."""
    disk_dir: str = ""
    """vllm-disk only: where PEFT directories are written; empty: a temporary directory."""
    transport: str = "auto"
    """How bucket bytes reach the engine (kinds that send buckets: vllm, receiver): auto (an engine on
    this host: shm on CPU, cuda_ipc on GPU; elsewhere: tcp), shm, cuda_ipc, tcp, nccl (a process group
    with the engine's workers, GPU engines on any host), or a registered plug-in."""
    tcp_host: str = ""
    """tcp and nccl: the address the trainer serves buckets (tcp) or its group's rendezvous (nccl) on, as
    the engine reaches it; empty: 127.0.0.1 for an engine on loopback, else this host's address on the
    route to the engine."""
    tcp_port: int = 0
    """tcp and nccl: the port the trainer serves on; 0: any free port."""
    nccl_backend: str = "nccl"
    """nccl only: "nccl" (GPU trainer and engine), or "gloo": the same group on CPU, for a trainer
    without CUDA (tests, CPU engines); nccl without CUDA is refused unless gloo is asked for here."""
    urls: list[str] = field(default_factory=list)
    """Attach to several independent engines (replicas) at these addresses; instead of `url`."""
    standby: str = "auto"
    """vLLM started by titan_lora: keep a pre-imported engine interpreter beside it, so that a restart skips
    importing vLLM (restarts ready in 8-11 s instead of 20-23 s on a 2-core CPU). It imports at a lowered
    priority after each start and holds about 0.6 GB of host memory while it waits. auto: on for a GPU
    engine (spare host cores hide the import), off on CPU (the import competes with the job); on; off."""
    replicas: int = 1
    """Engines titan_lora starts (each its own port: `port` + i, or any free ones); 1: one engine, as `url`
    empty does. Every version goes to every live replica; rollouts spread over them (docs/design.md)."""


@dataclass
class WeightSync:
    """`[weight_sync]`: keep the engine on the newest adapter after every optimizer step."""

    enabled: bool = False
    """Sync the adapter into the engine after every optimizer step (GRPO rollouts need it)."""
    lora_name: str = "policy"
    """The name the engine serves the adapter under (each version gets its own id)."""
    bucket_mb: int = 32
    """Size of one transfer bucket in MiB; the emitter keeps two (double-buffered)."""
    base: str = "verify"
    """How an engine gets the base: "verify" (an engine that loads the checkpoint itself, vLLM, has its
    digests compared with the trainer's and only differing tensors sent; one that cannot verify gets the
    whole base) or "push" (the whole base is sent to every engine incarnation)."""
    keep_versions: int = 2
    """Adapter versions kept live: >= [grpo] max_staleness + 1 (sync loop) or + 2 (async loop); when the
    config leaves it out, it is raised to that bound."""
    timeout_s: float = 120.0
    """Bound of one adapter transfer to the engine."""
    retries: int = 3
    """Retries of a failed engine operation (a transfer, a load) before it counts as an engine fault."""
    retire_timeout_s: float = 30.0
    """Bound of one unload of an expired adapter version (an install may wait this long for them)."""
    parity_every: int = 5
    """Run the trainer-vs-engine log-prob probe every N syncs; 0: never."""
    parity_tolerance: float = 1e-3
    """Largest |trainer - engine| log-prob difference of any probed token that the parity probe accepts."""
    parity_gate: bool = False
    """true: a version whose parity probe exceeds parity_tolerance is not published."""
    rollout_timeout_s: float = 600.0
    """Bound of one rollout or eval request to the engine."""
    health_timeout_s: float = 10.0
    """Bound of one engine health check; a hung engine is restarted."""
    engine_start_timeout_s: float = 600.0
    """Bound of an engine's start, or of the wait for an attached engine to come back."""
    engine_restarts: int = 3
    """Engine restarts tried per failing operation before giving up."""


@dataclass
class GRPO:
    """`[grpo]`: the RL objective. Defaults are near-on-policy, what LoRA RL needs to stay stable."""

    enabled: bool = False
    """Train with GRPO on engine rollouts instead of SFT on `[data]`."""
    prompts_per_step: int = 8
    """Prompts per optimizer step; each is sampled group_size times."""
    group_size: int = 8
    """Samples per prompt; advantages are normalised within each group."""
    max_new_tokens: int = 8
    """Longest completion sampled per rollout, in tokens (calculator_agent: per turn)."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts (1.0: the policy as trained)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to the base model (the adapter switched off); 0 skips that forward."""
    max_staleness: int = 1
    """S: no sample from an adapter version older than (current - S) is trained; older ones are dropped and
    counted (sync loop), or never admitted and re-drawn (async loop, docs/design.md)."""
    loop: str = "sync"
    """"sync": rollouts, then the step, then the sync, in turn. "async": rank 0 keeps the engine generating
    while the ranks train, at most (max_staleness + 1) x prompts_per_step groups ahead."""
    stale_weight_cap: float = 2.0
    """Cap of the importance weight pi_current / pi_behaviour (the engine's log-probs) that corrects a sample
    drawn under an older version (decoupled PPO with truncated importance sampling)."""
    task: str = "arith"
    """A registered task (arith, reverse, jsonl, word_problems, calculator_agent) or `package.module:factory`;
    its options are the `[task]` section (docs/extending.md). An agent task (docs/agents.md) runs episodes."""
    reward: str = ""
    """Empty: the task's own reward; else a registered reward name or `package.module:function`."""
    task_digits: int = 1
    """arith: operands of up to this many digits."""
    task_ops: str = "+-"
    """arith: the operators drawn from, any of + - * (e.g. "+-*")."""
    train_size: int = 2000
    """Training problems the task draws (seeded)."""
    eval_size: int = 100
    """Held-out problems scored greedily every eval_every steps."""
    eval_every: int = 5
    """Greedy held-out accuracy every N steps (and before the first); 0: never."""
    seed: int = 0
    """Seed of the task's problems and of the rollouts' sampling."""
    rollouts: bool = True
    """false: no engine rollouts (GPU timing without an inference engine); samples come from the data."""
    adapter_batches: str = "auto"
    """Several [[adapters]]: "one" runs every adapter's rows in one forward and one backward (the base computes
    once: fastest where memory allows, a GPU); "each" runs a forward and a backward per adapter, the gradients
    accumulating (activations of one adapter's rows at a time: K adapters in near one job's memory, and as
    fast on CPU); "auto": "each" on CPU, "one" on GPU."""


@dataclass
class Service:
    """`[service]`: `titan-lora serve`, the Tinker-compatible API over this config's model (docs/service.md)."""

    host: str = "127.0.0.1"
    """The address the API listens on (127.0.0.1: the local host only)."""
    port: int = 8000
    """The API's TCP port; 0 picks a free one (printed at start)."""
    base_model: str = ""
    """The name clients pass as `base_model` (e.g. "meta-llama/Llama-3.2-1B"), served by [model]'s weights;
    "": the name of [model]'s checkpoint directory."""
    api_keys: list[str] = field(default_factory=list)
    """The X-API-Key values let in (each starts with "tml-", as the tinker SDK requires); also from the
    environment's TITAN_LORA_API_KEYS (comma-separated). Each key sees only its own models."""
    max_adapters: int = 4
    """LoRA training clients live at once (adapter slots built into the model; each client takes one)."""
    max_adapters_per_key: int = 0
    """Training clients one API key may hold at once, so that one user cannot take every slot; 0: up to
    max_adapters."""
    max_rank: int = 32
    """The largest LoRA rank a client may ask for (each slot is built at this rank; a smaller one is exact)."""
    lora_alpha: float = 32.0
    """A client's adapter output is scaled by lora_alpha / its rank."""
    state_dir: str = "service_states"
    """Where save_state writes (one file per state); relative: under [job] dump_folder. Kept across restarts."""
    max_request_tokens: int = 65536
    """Tokens one forward/forward_backward request may carry (all its datums)."""
    micro_batch_tokens: int = 1024
    """Padded tokens (datums x the longest) one forward and backward covers: the calls of a step run in
    micro-batches of this size, so a step's memory does not grow with its size (the logits alone take
    vocab x 4 bytes a token). Raise it on a GPU with room for more."""
    max_queued: int = 256
    """Requests one client may have waiting; more are refused until some finish."""
    session_timeout_s: float = 120.0
    """A session not heard from for this long (the SDK beats every 10 s) ends, and its adapter slots are freed."""


@dataclass
class JobConfig:
    """Every section a TOML may name: the run's (`run_sections`, torchtitan 0.2.2's names) and titan_lora's."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    debug: Debug = field(default_factory=Debug)
    lora: LoRA = field(default_factory=LoRA)
    data: Data = field(default_factory=Data)
    engine: Engine = field(default_factory=Engine)
    weight_sync: WeightSync = field(default_factory=WeightSync)
    grpo: GRPO = field(default_factory=GRPO)
    service: Service = field(default_factory=Service)
    task: dict[str, str | int | float | bool | list] = field(default_factory=dict)
    """`[task]`: the options of the task `[grpo] task` names; that task checks them (rl/task.py)."""
    adapters: list[Adapter] = field(default_factory=list)
    """`[[adapters]]`: the job's LoRA adapters, one table each, set in the TOML only (config_adapters.py); none:
    one adapter, the [lora], [optimizer], [training], [grpo] and [data] sections, named [weight_sync]
    lora_name. Several tables train together in SFT jobs, keep checkpoints by adapter name and export one PEFT
    folder each (docs/multi_adapter.md); with GRPO or weight sync they are refused so far, one line each."""


def choices() -> dict[tuple[str, str], tuple[str, ...]]:
    """The string keys that take one of a fixed set of values (the validate_* functions refuse others);
    docs/config.md lists them."""
    return {("grpo", "loop"): GRPO_LOOPS, ("lora", "dtype"): ADAPTER_DTYPES, ("training", "on_nonfinite"): NONFINITE_POLICIES,
            ("engine", "pause_mode"): PAUSE_MODES, ("engine", "nccl_backend"): NCCL_BACKENDS,
            ("engine", "standby"): STANDBY_MODES}


def validate_lora(cfg: LoRA) -> None:
    """Reject a `[lora]` section that cannot work."""
    raise_range_errors("lora", cfg)
    if cfg.dtype not in ADAPTER_DTYPES:
        raise ValueError(f"[lora] dtype = {cfg.dtype!r} is not one of {', '.join(ADAPTER_DTYPES)}")
    targets = cfg.target_modules
    if isinstance(targets, str) and targets != "all-linear":
        raise ValueError(
            f'[lora] target_modules = {targets!r}: use a list of names such as ["wq", "wv"] '
            'or the string "all-linear"'
        )
    if isinstance(targets, list) and not targets:
        raise ValueError('[lora] target_modules is empty: name some linears or use "all-linear"')
    if cfg.export_dir:
        check_writable_dir(cfg.export_dir, "[lora] export_dir")


def check_writable_dir(path: str, key: str) -> None:
    """Fail early if `path` cannot be created or written."""
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    try:  # really create something: os.access says yes to root even under /proc
        os.rmdir(tempfile.mkdtemp(dir=parent, prefix=".titan_lora_probe_"))
    except OSError as err:
        raise ValueError(
            f"{key} = {path!r} cannot be written ({parent!r}: {err.strerror}); "
            "choose a path under a directory you own"
        ) from None


NONFINITE_POLICIES = ("stop", "rollback")
BACKOFF_CAP_S = 10.0
"""The longest sleep between two retries of one request."""
DEFAULT_PG_TIMEOUT_S = 600.0
MAX_PG_TIMEOUT_S = 7 * 86400.0
"""The longest process-group timeout a config may derive: a week, far inside what torch's timeouts hold."""


def rank0_wait_budget_s(ws: WeightSync) -> float:
    """The longest rank 0 may work between two collectives: retries and engine restarts included."""
    # An adapter install may first wait up to retire_timeout_s for lagging retirements.
    transfer = (ws.retries + 1) * (ws.timeout_s + BACKOFF_CAP_S) + ws.retire_timeout_s
    per_try = max(ws.rollout_timeout_s, transfer)
    restarts = ws.engine_restarts * (ws.engine_start_timeout_s + ws.health_timeout_s)
    return (ws.engine_restarts + 1) * per_try + restarts


def process_group_timeout_s(ws: WeightSync) -> float:
    """The process-group timeout: rank 0's own errors must surface before a collective times out."""
    if not ws.enabled:
        return DEFAULT_PG_TIMEOUT_S
    return max(DEFAULT_PG_TIMEOUT_S, rank0_wait_budget_s(ws) + 120.0)


def validate_training(cfg: Training) -> None:
    """Reject titan_lora's `[training]` keys that cannot work."""
    if cfg.on_nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f'[training] on_nonfinite = {cfg.on_nonfinite!r}: use "stop" or "rollback"')


PAUSE_MODES = ("none", "abort", "retract", "in_place")
UNSPECIFIED_HOSTS = ("0.0.0.0", "::", "[::]")
NCCL_BACKENDS = ("nccl", "gloo")
STANDBY_MODES = ("auto", "on", "off")


def validate_engine(cfg: Engine) -> None:
    """Reject an `[engine]` section whose values cannot work (its kind is checked against the registry)."""
    raise_range_errors("engine", cfg)
    if cfg.pause_mode not in PAUSE_MODES:
        raise ValueError(f"[engine] pause_mode = {cfg.pause_mode!r}: use {', '.join(PAUSE_MODES)}")
    if cfg.tcp_host in UNSPECIFIED_HOSTS:
        raise ValueError(f"[engine] tcp_host = {cfg.tcp_host!r} is the address the engine connects to: name "
                         "this host's address as the engine sees it, or leave it empty to derive it")
    if cfg.nccl_backend not in NCCL_BACKENDS:
        raise ValueError(f"[engine] nccl_backend = {cfg.nccl_backend!r}: use {' or '.join(NCCL_BACKENDS)}")
    if cfg.standby not in STANDBY_MODES:
        raise ValueError(f"[engine] standby = {cfg.standby!r}: use {', '.join(STANDBY_MODES)}")
    if cfg.disk_dir:
        check_writable_dir(cfg.disk_dir, "[engine] disk_dir")
    _check_replicas(cfg)


def attached_urls(cfg: Engine) -> list[str]:
    """The running engines `[engine]` attaches to: `urls`, else `url` alone; empty: titan_lora starts them."""
    return list(cfg.urls) or ([cfg.url] if cfg.url else [])


def _is_address(url: str) -> bool:
    try:
        parts = urlsplit(url)
        parts.port  # raises on a port that is not a number in [0, 65535]
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def _check_replicas(cfg: Engine) -> None:
    if cfg.urls and cfg.url:
        raise ValueError("[engine] url and urls are both set: list every engine in urls and remove url")
    if cfg.urls and cfg.replicas > 1:
        raise ValueError(f"[engine] urls attaches to {len(cfg.urls)} running engines and replicas = {cfg.replicas} "
                         "starts engines: use one of them (remove replicas to attach, or urls to start)")
    for url in attached_urls(cfg):
        if not _is_address(url):
            raise ValueError(f"[engine] {'urls' if cfg.urls else 'url'}: {url!r} is not an engine address; "
                             'use "http://host:port"')
    if len(set(cfg.urls)) != len(cfg.urls):
        dup = sorted({u for u in cfg.urls if cfg.urls.count(u) > 1})
        raise ValueError(f"[engine] urls names {dup} more than once: each replica is a separate engine")
    if cfg.port and cfg.port + cfg.replicas - 1 > 65535:
        raise ValueError(f"[engine] port = {cfg.port} with replicas = {cfg.replicas}: replica i takes port + i, "
                         "past 65535; lower port, or set it to 0 to pick free ones")


BASE_MODES = ("verify", "push")


def validate_weight_sync(cfg: WeightSync) -> None:
    """Reject a `[weight_sync]` section that cannot work."""
    raise_range_errors("weight_sync", cfg)
    if cfg.enabled and process_group_timeout_s(cfg) > MAX_PG_TIMEOUT_S:
        raise ValueError(f"[weight_sync] timeouts, retries and engine_restarts let rank 0 wait "
                         f"{rank0_wait_budget_s(cfg):.0f} s between collectives, past the process-group timeout's "
                         f"limit of {MAX_PG_TIMEOUT_S:g} s (a week); lower the *_timeout_s keys, retries or "
                         "engine_restarts")
    if cfg.base not in BASE_MODES:
        raise ValueError(f'[weight_sync] base = {cfg.base!r}: use "verify" (the engine loads the base itself and '
                         'the trainer checks its digests) or "push" (the trainer sends it)')


GRPO_LOOPS = ("sync", "async")
ADAPTER_BATCHES = ("auto", "one", "each")


def versions_needed(cfg: GRPO) -> int:
    """The adapter versions an engine must keep for `[grpo]`: every version a trainable sample may come from
    (S + 1), plus, in the async loop, the one being published while requests pinned to the oldest run."""
    if not cfg.enabled:
        return 2
    return cfg.max_staleness + (2 if cfg.loop == "async" else 1)


def validate_grpo(cfg: GRPO, weight_sync: WeightSync) -> None:
    """Reject a `[grpo]` section that cannot work."""
    raise_range_errors("grpo", cfg)
    if cfg.loop not in GRPO_LOOPS:
        raise ValueError(f'[grpo] loop = {cfg.loop!r}: use "sync" or "async"')
    if cfg.adapter_batches not in ADAPTER_BATCHES:
        raise ValueError(f'[grpo] adapter_batches = {cfg.adapter_batches!r}: use "auto", "one" (every adapter\'s '
                         'rows in one forward) or "each" (a forward and backward per adapter)')
    if not cfg.enabled:
        return
    if cfg.prompts_per_step > cfg.train_size:
        raise ValueError(f"[grpo] prompts_per_step = {cfg.prompts_per_step} is more than train_size = "
                         f"{cfg.train_size}: a step draws distinct problems; lower it or raise train_size")
    if cfg.rollouts and not weight_sync.enabled:
        raise ValueError("[grpo] rollouts come from the engine: set [weight_sync] enabled = true "
                         "(or [grpo] rollouts = false to time training without an engine)")
    if cfg.loop == "async" and not cfg.rollouts:
        raise ValueError('[grpo] loop = "async" overlaps rollouts with training: it needs [grpo] rollouts = true')
    need = versions_needed(cfg)
    if weight_sync.enabled and weight_sync.keep_versions < need:
        why = "+ 2 (async loop)" if cfg.loop == "async" else "+ 1"
        raise ValueError(f"[weight_sync] keep_versions = {weight_sync.keep_versions} must be >= [grpo] "
                         f"max_staleness {why} = {need}; raise it, or leave it out to have it derived")

