"""What titan_lora checks before it sends anything to an SGLang 0.5.23 server.

A control request that raises inside SGLang's scheduler ends the server (the scheduler runs them with
no error catching), so every rule SGLang enforces by raising is checked here first, with an error
that names the fix. The file:line citations are in docs/sglang.md.
"""

from __future__ import annotations

import enum
import json
import math
import os
import re
import socket
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from titan_lora.clients.sglang_api import ServerInfo
from titan_lora.transfer.errors import TransferError
from titan_lora.transfer.protocol import EngineLimits

# SGLang fuses these projections: a server target covers its whole group (sglang/srt/lora/utils.py).
_FUSED = ({"q_proj", "k_proj", "v_proj", "qkv_proj"}, {"gate_proj", "up_proj", "gate_up_proj"})
_LORA_WEIGHT = re.compile(r"\.([^.]+)\.lora_(?:A|B|embedding_A|embedding_B)(?:\.weight)?$")


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, enum.Enum):
        return value.value
    raise TypeError(f"adapter_config value {value!r} is not JSON-serializable")


def sglang_adapter_config(peft_config: Mapping[str, Any]) -> dict[str, Any]:
    """The adapter_config to send: JSON-clean, `peft_type` "LORA", rsLoRA folded into `lora_alpha`.

    SGLang 0.5.23 reads only r, lora_alpha, target_modules and use_dora, and scales by lora_alpha / r
    (sglang/srt/lora/lora.py): it would serve an rsLoRA adapter with the wrong scale, and silently
    drop per-module ranks/alphas and modules_to_save. It asserts peft_type == "lora" while it loads,
    which would end the server, so a config without one gets "LORA" and any other type is refused.
    """
    cfg = json.loads(json.dumps(dict(peft_config), default=_jsonable))
    missing = [k for k in ("r", "lora_alpha", "target_modules") if k not in cfg]
    if missing:
        raise TransferError(f"adapter_config lacks {missing}: export the PEFT LoraConfig.to_dict()")
    if str(cfg.setdefault("peft_type", "LORA")).lower() != "lora":
        raise TransferError(f"adapter_config has peft_type={cfg['peft_type']!r}; SGLang 0.5.23 serves only "
                            "LORA adapters: train a plain LoRA adapter")
    ignored = [k for k in ("rank_pattern", "alpha_pattern", "modules_to_save", "use_dora") if cfg.get(k)]
    if cfg.get("bias", "none") != "none":
        ignored.append(f"bias={cfg['bias']!r}")
    if ignored:
        raise TransferError(f"the adapter_config sets {ignored}, which SGLang 0.5.23 ignores or refuses; "
                           "train the adapter without them")
    if cfg.get("use_rslora"):
        cfg["lora_alpha"] = cfg["lora_alpha"] * math.sqrt(cfg["r"])  # alpha/sqrt(r) == alpha'/r
        cfg["use_rslora"] = False
    return cfg


def served_modules(targets: frozenset[str] | None) -> frozenset[str] | None:
    """HF leaf names a server with `--lora-target-modules targets` adapts; None: every linear."""
    if targets is None or "all" in targets:
        return None
    out = set(targets)
    for group in _FUSED:
        if out & group:
            out |= group
    return frozenset(out)


def adapter_modules(names: Sequence[str]) -> set[str]:
    """Leaf module names that an adapter's tensors adapt (`...q_proj.lora_A.weight` -> q_proj)."""
    found = {m.group(1) for n in names if (m := _LORA_WEIGHT.search(n))}
    if not found:
        raise TransferError(f"no LoRA tensor names in the adapter (e.g. {list(names)[:2]}); expected PEFT "
                           "names such as base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
    return found


def check_fused_targets(modules: set[str] | frozenset[str]) -> None:
    """Refuse target sets that SGLang 0.5.23 cannot fuse into qkv_proj / gate_up_proj.

    SGLang stacks q, k and v from each q_proj tensor: k may be missing (zeros) but v may not, so q or
    q+k is refused with a bare KeyError, and k or v without q is never stacked at all: it loads, then
    ends the server on the first /generate that uses it. gate_proj stacks with a zero up_proj, but
    up_proj without gate_proj is never stacked and fails the same way.
    """
    qkv = modules & {"q_proj", "k_proj", "v_proj"}
    problems = []
    if qkv and not {"q_proj", "v_proj"} <= qkv:
        problems.append(f"{sorted(qkv)} (SGLang fuses q/k/v and needs q_proj and v_proj together)")
    if "up_proj" in modules and "gate_proj" not in modules:
        problems.append("['up_proj'] without gate_proj (SGLang fuses gate/up from gate_proj)")
    if problems:
        raise TransferError(f"SGLang 0.5.23 cannot serve an adapter on {' and '.join(problems)}: add the "
                            "missing modules to [lora] target_modules (e.g. q_proj,v_proj or gate_proj,up_proj)")


def check_server(info: ServerInfo, url: str, keep_versions: int) -> EngineLimits:
    """EngineLimits of a server, or an error naming the SGLang flag that must change."""
    def fail(problem: str, fix: str) -> TransferError:
        return TransferError(f"SGLang at {url} {problem}: restart it with {fix}")

    if not info.enable_lora:
        raise fail("was started without LoRA", "--enable-lora --max-lora-rank R --lora-target-modules ...")
    if info.attn_dp_size > 1:
        raise fail(f"runs DP attention (attn_dp_size={info.attn_dp_size}), where 0.5.23 serves only pinned "
                   "adapters, which it never evicts", "no --enable-dp-attention (one server per replica)")
    if info.dp_size != 1:
        raise fail(f"runs dp_size={info.dp_size}, and 0.5.23 loads adapters only with one replica",
                   "--dp-size 1 (one server per replica)")
    if info.max_lora_rank is None or info.lora_target_modules is None:
        raise fail("did not state its LoRA rank and targets (they were inferred from --lora-paths)",
                   "--max-lora-rank R --lora-target-modules <modules|all>")
    slots = keep_versions + 1  # the retention window plus the version being loaded
    # A batch also spends one of its max_loras_per_batch slots on base-only requests.
    for flag, value, need in (("--max-loaded-loras", info.max_loaded_loras, slots),
                              ("--max-loras-per-batch", info.max_loras_per_batch, slots + 1)):
        if value is not None and value < need:
            extra = " plus one for base-only requests" if need > slots else ""
            raise fail(f"holds {flag.strip('-').replace('-', '_')}={value} adapters, fewer than "
                       f"keep_versions + 1 = {slots}{extra}",
                       f"{flag} {need} (or lower [weight_sync] keep_versions)")
    caps = [v for v in (info.max_loaded_loras, info.max_loras_per_batch - 1) if v is not None]
    # SGLang loads no adapter on routed experts (sgl-project/sglang #9897)
    return EngineLimits(info.max_lora_rank, min(caps), served_modules(info.lora_target_modules), expert_lora=False)


def check_adapter(limits: EngineLimits, url: str, rank: int, modules: set[str]) -> None:
    """Raise, naming the fix, if the server cannot hold an adapter of `rank` on `modules`."""
    check_fused_targets(modules)
    if rank > limits.max_lora_rank:
        raise TransferError(f"SGLang at {url} serves LoRA rank <= {limits.max_lora_rank}, the adapter has "
                           f"rank {rank}: restart it with --max-lora-rank {rank}")
    missing = set() if limits.target_modules is None else modules - limits.target_modules
    if missing:
        raise TransferError(f"SGLang at {url} does not adapt {sorted(missing)} (it serves "
                           f"{sorted(limits.target_modules or [])}): restart it with --lora-target-modules "
                           f"{' '.join(sorted(modules))} (or all)")


# ---- where the engine is: CUDA IPC handles only for an engine on this host that sees this GPU --------


def _is_local(host: str) -> bool:
    """True if `host` names the local host (loopback, or one of its addresses)."""
    try:
        addrs = {a[4][0] for a in socket.getaddrinfo(host, None)}
        mine = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        return False
    return all(a.startswith("127.") or a == "::1" or a in mine for a in addrs)


def _listener_pids(port: int) -> set[int]:
    """Pids of this host's processes listening on TCP `port` (Linux /proc; empty where unreadable)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = [r.split() for r in f.readlines()[1:]]
        except OSError:
            continue
        # local_address is HEXIP:HEXPORT; state 0A is LISTEN; the inode is column 9.
        inodes |= {r[9] for r in rows if int(r[1].rsplit(":", 1)[1], 16) == port and r[3] == "0A"}
    pids = set()
    for pid in filter(str.isdigit, os.listdir("/proc") if inodes else []):
        try:
            links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        except OSError:
            continue
        if any(f"socket:[{i}]" in links for i in inodes):
            pids.add(int(pid))
    return pids


def _visible_devices(pid: int) -> str | None:
    """CUDA_VISIBLE_DEVICES of process `pid` ("" if unset); None if its environment is unreadable."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return None
    return env.get(b"CUDA_VISIBLE_DEVICES", b"").decode()


def engine_sees_gpu(host: str, port: int, info: ServerInfo, gpu_index: int) -> bool:
    """Whether the engine can open CUDA IPC handles of our GPU `gpu_index`: a CUDA engine on this host
    whose process (found by its listening port) has this GPU among its CUDA_VISIBLE_DEVICES.

    Anything unknown answers False: bytes always work, while a handle the engine cannot open ends it
    (patch_torch.py resolves the GPU UUID among the engine's visible devices, or raises).
    """
    if info.device != "cuda" or not _is_local(host):
        return False
    seen = [_visible_devices(p) for p in _listener_pids(port)]
    if not seen or None in seen:
        return False
    bare = str(torch.cuda.get_device_properties(gpu_index).uuid).removeprefix("GPU-")
    ours = {bare, f"GPU-{bare}"}
    # By index only where our own CUDA_VISIBLE_DEVICES is unset (then our index is the physical one).
    if not os.environ.get("CUDA_VISIBLE_DEVICES"):
        ours.add(str(gpu_index))
    return all(not v or ours & {d.strip() for d in v.split(",")} for v in seen if v is not None)
