"""IPC soak: many bucket posts into a receiver process, every checksum verified.

GPU (CUDA IPC; the receiver maps the trainer's buffers on the same GPU):
    python scripts/ipc_soak.py --device cuda:0                 # 20,000 posts, 256 MiB buckets
CPU (shared memory in /dev/shm), small enough for a test:
    python scripts/ipc_soak.py --device cpu --posts 200 --bucket-mb 1 --tensor-mb 0.25

The allocation history is the one that made the engine read the wrong buffer: a loaded model, then
`--free-gib` allocated and freed, then the two bucket buffers (on CUDA both are carved from the freed
segment and share its IPC handle). Every transfer sends new values; the emitter checks each bucket's
acknowledged checksum. The trainer side runs in a process of its own; the /dev/shm entries are counted
before it starts and after it exited. It prints posts/s, checksum mismatches, other errors and those
counts, and exits 0 only if every post was verified, the receiver still answered, the trainer exited 0
without torch's "producer terminated" warning, and no buffer, CUDA IPC ref counter or torch segment is
left in /dev/shm.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_lora.clients.base import AdapterPayload
from titan_lora.clients.http import JsonClient
from titan_lora.clients.launch import EmbeddedEngine
from titan_lora.clients.vllm import VLLMBucketEmitter, receiver_plan
from titan_lora.transfer.errors import TransferError
from titan_lora.transfer.transport import SHM_DIR

# What a trainer and its receiver create in /dev/shm: bucket buffers, CUDA IPC ref counters, torch's
# shared CPU tensors. Other names (another job's semaphores on a shared host) are not counted as leaks.
OURS = ("psm_", "cuda.shm.", "torch_")


def shm_entries() -> set[str]:
    """Names in /dev/shm now."""
    return set(os.listdir(SHM_DIR))


def receiver(device: torch.device, log_path: str) -> EmbeddedEngine:
    """The receiver as a job would start it, bound to `device` (not started)."""
    return EmbeddedEngine(receiver_plan(device), 0, log_path, start_timeout_s=120.0)


def allocation_history(device: torch.device, model_gib: float, free_gib: float) -> list[torch.Tensor]:
    """A loaded model (kept) and a large temporary (freed), as a trainer's allocator has seen them."""
    model = [torch.ones(int(model_gib * 2**30) // 4, dtype=torch.float32, device=device)] if model_gib else []
    scratch = torch.empty(int(free_gib * 2**30), dtype=torch.uint8, device=device)
    del scratch  # its segment stays cached: the bucket buffers are carved from it
    return model


def soak(args: argparse.Namespace) -> dict:
    """Run the posts; return the figures."""
    device = torch.device(args.device)
    model = allocation_history(device, args.model_gib, args.free_gib)
    numel = int(args.tensor_mb * 2**20) // 4
    gen = torch.Generator().manual_seed(0)
    tensors = {f"base_model.model.layers.{i}.mlp.down_proj.lora_A.weight":
               torch.randn(numel, generator=gen).to(device) for i in range(args.tensors)}
    engine = receiver(device, args.log)
    engine.start()
    receiver_pid = engine.proc.pid
    emitter = VLLMBucketEmitter(JsonClient(engine.url, engine.key, timeout_s=60), args.bucket_mb)
    figures = {"posts": 0, "mismatches": 0, "errors": 0, "receiver_alive": False, "receiver_pid": receiver_pid}
    try:
        started, version = time.perf_counter(), 0
        while figures["posts"] < args.posts:
            version += 1
            for t in tensors.values():  # new values every transfer: a stale or misplaced read shows
                t.add_(1.0)
            try:
                ack = emitter.send_adapter(AdapterPayload("soak", version, tensors, {}))
                figures["posts"] += int(ack.phases_ms["buckets"])
            except TransferError as err:
                figures["mismatches" if "checksum" in str(err) else "errors"] += 1
                figures["posts"] += 1
                print(f"transfer {version}: {err}", file=sys.stderr)
                if figures["mismatches"] + figures["errors"] >= args.max_failures:
                    break
        figures["seconds"] = time.perf_counter() - started
        figures["receiver_alive"] = engine.healthy(timeout_s=60)
    finally:
        engine.stop()  # the receiver unmaps our buffers as it exits; only then may we free them
        emitter.close()
        del model
    return figures


def driver_files(names: list[str], pids: list[int]) -> list[str]:
    """The CUDA driver's own per-process IPC file, `cuda.shm.<device>.<pid in hex>.<n>` (4 KiB): the
    driver leaves one for each process that used CUDA IPC, whatever the number of posts."""
    return [n for n in names if n.startswith("cuda.shm.") and n.split(".")[3:4] in ([f"{p:x}"] for p in pids)]


# torch prints this at exit when CUDA blocks it shared were still mapped elsewhere (their ref-counter
# file then stays in /dev/shm).
PRODUCER_WARNING = "Producer process has been terminated before all shared CUDA tensors released"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--posts", type=int, default=20_000, help="bucket posts (each checksum-verified)")
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--tensor-mb", type=float, default=48.0, help="size of each adapter tensor")
    ap.add_argument("--tensors", type=int, default=8, help="tensors per transfer (8 x 48 MiB: 2 buckets)")
    ap.add_argument("--model-gib", type=float, default=2.0, help="memory held as 'the model' (0 on CPU)")
    ap.add_argument("--free-gib", type=float, default=1.0, help="allocated and freed before the buffers")
    ap.add_argument("--max-failures", type=int, default=20, help="stop after this many failed transfers")
    ap.add_argument("--log", default=os.path.join(tempfile.gettempdir(), "ipc-soak-receiver.log"),
                    help="where the receiver process logs")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="give up on a trainer that runs longer")
    ap.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)  # the child: run the soak
    args = ap.parse_args(argv)
    if args.device == "cpu":  # host memory: no model to load, and the free has no segment to leave
        args.model_gib, args.free_gib = 0.0, min(args.free_gib, 0.01)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the soak in a trainer process of its own; count /dev/shm once it has exited; 0 if all is well.

    The count is taken after the trainer exits because torch keeps one CUDA IPC ref-counter file per
    producer process for as long as it lives: only what outlives the process is a leak."""
    args = parse_args(argv)
    if args.trainer:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # unwind: the finally cleans up
        print("FIGURES " + json.dumps(soak(args)), flush=True)
        return 0
    before = shm_entries()
    child = subprocess.Popen([sys.executable, __file__, "--trainer", *(argv if argv is not None else sys.argv[1:])],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:  # a hung trainer or receiver must not hang the soak: 20,000 posts take about a minute
        stdout, stderr = child.communicate(timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        child.terminate()  # it unwinds: stops the receiver, then frees and unlinks its buffers
        try:
            stdout, stderr = child.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            stdout, stderr = child.communicate()
        print(f"FAILED: the trainer process did not finish within --timeout-s {args.timeout_s:.0f}")
        sys.stderr.write(stderr)
        return 1
    after = shm_entries()
    sys.stderr.write(stderr)
    lines = [line for line in stdout.splitlines() if line.startswith("FIGURES ")]
    if child.returncode != 0 or not lines:
        print(f"FAILED: the trainer process exited {child.returncode}")
        return 1
    figures = json.loads(lines[-1].removeprefix("FIGURES "))
    posts_s = figures["posts"] / figures["seconds"] if figures.get("seconds") else 0.0
    print(f"device {args.device}: {figures['posts']} posts in {figures.get('seconds', 0):.1f} s "
          f"({posts_s:.0f} posts/s), {figures['mismatches']} checksum mismatches, {figures['errors']} other "
          f"errors, receiver alive: {figures['receiver_alive']}, trainer exit code {child.returncode}")
    left = sorted(n for n in after - before if n.startswith(OURS))
    driver = driver_files(left, [child.pid, figures["receiver_pid"]])
    leaked = [n for n in left if n not in driver]
    warned = PRODUCER_WARNING in stderr
    print(f"/dev/shm entries: {len(before)} before, {len(after)} after the trainer exited; left by this run: "
          f"{leaked[:10]}, and the CUDA driver's per-process file(s) {driver} (trainer pid {child.pid}, receiver "
          f"pid {figures['receiver_pid']}); torch's producer warning at exit: {warned}")
    ok = (figures["posts"] >= args.posts and not figures["mismatches"] and not figures["errors"]
          and figures["receiver_alive"] and not leaked and not warned)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
