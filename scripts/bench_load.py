"""Checkpoint-load benchmark: a synthetic Llama-3 HF checkpoint loaded into an FSDP (and TP) model on N ranks,
the former way (every rank reads every tensor whole) and the sliced way (each rank its shards' slices),
beside the floor (one sequential read of the checkpoint's bytes from the same disk, in the same run).

    python scripts/bench_load.py [--shape 1b|8b|70b|tiny] [--layers N] [--ranks 2] [--tp 1] [--device cpu|cuda]
        [--dir PATH] [--shard-gb 5] [--no-drop]

The checkpoint (random bf16, sharded safetensors with an index, Llama-3 names and config.json) is written
under `--dir` at the start and removed at the end. `--layers` cuts the shape (the 70B shape fits a disk of
64 GB at 20 layers); every figure is for the layers written. Each path runs in fresh processes; a rank's
peak RSS is its VmHWM over the load (reset at its start through /proc/self/clear_refs): on CPU it
includes the model's own shard (fp32, printed as "RSS before"), on GPU the model is on the device. The
page cache is dropped before each measurement where /proc/sys/vm/drop_caches accepts it (the header says
whether it did); else every read is from a warm cache.

Goals: peak RSS per rank <= 1.25 x checkpoint bytes / ranks + 2 GiB; load time <= 1.5 x floor.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_base_send import llama3_shapes

from titan_lora.models.load import load_base_weights, load_base_weights_full
from titan_lora.titan.parallel import build_parallel_dims
from titan_lora.trainer.build import build_model
from titan_lora.trainer.distributed import leave_distributed
from titan_lora.trainer.job_config import job_from_toml

GiB = 1 << 30
# Llama-3.2-1B's width (untied here), Llama-3-8B, Llama-3-70B: (dim, heads, kv rows, ffn, vocab, layers);
# "tiny" (an odd vocabulary above SmolLM2 tokenizer's ids, two KV heads: TP=2 must divide them) is the smoke
# tests'.
SHAPES = {"1b": (2048, 32, 512, 8192, 128256, 16), "8b": (4096, 32, 1024, 14336, 128256, 32),
          "70b": (8192, 64, 1024, 28672, 128256, 80), "tiny": (256, 4, 128, 512, 49157, 2)}
PATHS = {"old": "full read on every rank", "new": "slices of the rank's own shards"}


def write_checkpoint(out: Path, shape: str, layers: int, shard_bytes: int) -> int:
    """A random bf16 Llama-3 checkpoint of `shape` cut to `layers`, sharded, with an index; its bytes."""
    dim, heads, kv, hidden, vocab, _ = SHAPES[shape]
    out.mkdir(parents=True, exist_ok=True)
    made: dict[tuple[int, ...], torch.Tensor] = {}  # one random tensor per shape: writing is disk-bound
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    total = 0

    def flush() -> None:
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    for name, dims in llama3_shapes(layers, vocab, dim, kv, hidden):
        if dims not in made:
            g = torch.Generator().manual_seed(len(made))
            made[dims] = (torch.randn(dims, generator=g) * 0.02).bfloat16()
        shard[name] = made[dims].clone()  # safetensors refuses tensors that share memory
        total += shard[name].nbytes
        if sum(t.nbytes for t in shard.values()) >= shard_bytes:
            flush()
    if shard:
        flush()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": dim,
        "num_attention_heads": heads, "num_key_value_heads": kv // (dim // heads),
        "intermediate_size": hidden,
        "num_hidden_layers": layers, "vocab_size": vocab, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": False, "hidden_act": "silu",
        "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001}))
    return total


def drop_page_cache() -> str | None:
    """Drop the page cache (None), or why it could not be."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as e:
        return str(e)
    return None


def read_once(hf_dir: Path) -> float:
    """Seconds to read every byte of the checkpoint's files once, sequentially, in 64 MiB reads."""
    buf = memoryview(bytearray(64 << 20))
    t0 = time.perf_counter()
    for f in sorted(hf_dir.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    return time.perf_counter() - t0


def job_toml(hf_dir: Path, tp: int) -> str:
    """A LoRA job on the checkpoint, bf16 compute, FSDP over the ranks (and TP)."""
    return f"""
[model]
name = "llama3"
hf_assets_path = "{hf_dir}"
load_pretrained = true
converters = ["lora"]
[lora]
rank = 16
alpha = 32
target_modules = "all-linear"
[training]
seq_len = 64
[activation_checkpoint]
mode = "none"
[parallelism]
tensor_parallel_degree = {tp}
"""


def status_bytes(field: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # kB


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (VmHWM) to its RSS now (Linux >= 4.0); False where refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def model_on_rank(rank: int, world: int, port: int, hf_dir: Path, device_type: str, tp: int):  # noqa: ANN201
    """Join the process group as `rank` and build the job's model on the checkpoint's shape, weights not
    loaded; (the built model, its device)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                            device_id=device if device.type == "cuda" else None)
    cfg, resolved = job_from_toml(job_toml(hf_dir, tp))
    dims = build_parallel_dims(cfg.parallelism, world, device)
    return build_model(cfg, dims, device, dataclasses.replace(resolved, load_pretrained=False)), device


def _rank(rank: int, world: int, port: int, hf_dir: Path, path: str, device_type: str, tp: int,
          out: Path) -> None:
    built, device = model_on_rank(rank, world, port, hf_dir, device_type, tp)
    before = status_bytes("VmRSS")
    reset = reset_peak_rss()
    dist.barrier()
    t0 = time.perf_counter()
    if path == "old":
        load_base_weights_full(built.model, hf_dir, built.sd_adapter, built.tied)
    else:
        load_base_weights(built.model, hf_dir, built.sd_adapter, built.tied)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    peak = status_bytes("VmHWM")  # since the reset: the load's own peak (else since the process began)
    (out / f"{path}-{rank}.json").write_text(json.dumps({"seconds": seconds, "peak": peak, "before": before,
                                                         "reset": reset}))
    del built
    leave_distributed()


def run_path(path: str, args: argparse.Namespace, hf_dir: Path, out: Path) -> list[dict[str, float]]:
    """Load the checkpoint `path`'s way on `--ranks` fresh processes; each rank's figures."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(args.ranks, port, hf_dir, path, args.device, args.tp, out), nprocs=args.ranks)
    return [json.loads((out / f"{path}-{r}.json").read_text()) for r in range(args.ranks)]


def main() -> None:
    """Write the checkpoint, measure the floor and both loads, print them against the goals."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--layers", type=int, default=None, help="layers written (default: the shape's own)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--device", choices=("cpu", "cuda"),
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dir", type=Path, default=None, help="where to write the checkpoint (default: tmp)")
    ap.add_argument("--shard-gb", type=float, default=5.0)
    ap.add_argument("--no-drop", action="store_true", help="leave the page cache alone (every read warm)")
    args = ap.parse_args()
    layers = args.layers or SHAPES[args.shape][-1]
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)  # a path that does not exist yet is created, not refused
    root = Path(tempfile.mkdtemp(prefix="bench_load_", dir=args.dir))
    try:
        hf_dir = root / "ckpt"
        nbytes = write_checkpoint(hf_dir, args.shape, layers, int(args.shard_gb * 1e9))
        dropped = None if args.no_drop else drop_page_cache()
        cache = ("warm (--no-drop)" if args.no_drop else "dropped before each measurement" if dropped is None
                 else f"warm: drop_caches refused ({dropped})")
        floor = read_once(hf_dir)
        results = {}
        for path in PATHS:
            if not args.no_drop:
                drop_page_cache()
            results[path] = run_path(path, args, hf_dir, root)
        report(args, layers, nbytes, len(list(hf_dir.glob("*.safetensors"))), cache, floor, results)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def report(args: argparse.Namespace, layers: int, nbytes: int, files: int, cache: str, floor: float,
           results: dict[str, list[dict[str, float]]]) -> None:
    """The figures beside the floor and the goals, as ratios."""
    share = nbytes / args.ranks
    rss_goal = 1.25 * share + 2 * GiB
    print(f"\nbench_load: Llama-3 {args.shape} shape, {layers} of {SHAPES[args.shape][-1]} layers, "
          f"{nbytes / 1e9:.2f} GB bf16 in {files} files; {args.ranks} ranks ({args.device}, tp {args.tp}); "
          f"page cache: {cache}")
    print(f"goals: load <= 1.5 x floor; peak RSS/rank <= 1.25 x {share / GiB:.2f} GiB + 2 GiB = "
          f"{rss_goal / GiB:.2f} GiB")
    print(f"{'figure':44s} {'load s':>8s} {'x floor':>8s} {'peak RSS GiB':>13s} {'x RSS goal':>11s} "
          f"{'RSS before GiB':>15s}")
    print(f"{'floor: one sequential read of the bytes':44s} {floor:8.2f} {1.0:8.2f}")
    for path, ranks in results.items():
        seconds, peak = max(r["seconds"] for r in ranks), max(r["peak"] for r in ranks)
        before = max(r["before"] for r in ranks)
        print(f"{path + ': ' + PATHS[path]:44s} {seconds:8.2f} {seconds / floor:8.2f} {peak / GiB:13.2f} "
              f"{peak / rss_goal:11.2f} {before / GiB:15.2f}")
    since = "the load's start" if all(r["reset"] for rs in results.values() for r in rs) else \
        "the process's start (clear_refs refused)"
    print(f"(load s and peak RSS: the slowest and the largest rank, peak RSS since {since}; RSS before: the "
          "rank's RSS once the model was built" + (", the model's fp32 shard included" if args.device == "cpu"
                                                   else "") + ")")


if __name__ == "__main__":
    main()
