"""The 8B job on the receiver: a synthetic Llama-3 checkpoint loaded in slices by N ranks, the base streamed
from the ranks' own shards into titan_lora's receiver process (which has no checkpoint, so it cannot verify
and gets the whole base), then GRPO steps (`rollouts = false`: no inference engine on the GPU hosts) with
the adapter synced after each; beside the floor and the baseline, in one run.

    python scripts/bench_base_stream.py [--shape 8b] [--layers N] [--ranks 2] [--steps 8] [--device cuda|cpu]
        [--dir PATH]

Figures: the job's load time and its base stream (from its log), every process's peak host RSS (VmHWM,
sampled until it exits: each rank and the receiver), the steps' sync and step times (TensorBoard).
Floor for the stream: one NCCL (gloo on CPU) all-gather of the base's bytes into rank 0, the link bound
of moving every shard there, measured in the same run on fresh ranks.
Baseline (what titan_lora did before it streamed the base, and what a trainer that keeps the base to re-feed engines
does): the whole state dict gathered into rank 0's host memory (`get_model_state_dict(full_state_dict=True,
cpu_offload=True)`), its time and the peak RSS it costs.
Goal: streaming holds at most two tensors' buckets on the host at once, so rank 0's peak RSS
stays about its own share, not the base.

`--shape tiny --device cpu` is the smoke test (tests/test_bench_base_stream.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_load import SHAPES, job_toml, model_on_rank, reset_peak_rss, status_bytes, write_checkpoint
from plot_run import read_scalars

from titan_lora.models.load import load_base_weights
from titan_lora.models.smollm2 import pretrained_dir
from titan_lora.trainer.distributed import leave_distributed

GiB = 1 << 30
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
PROCESSES = {"titan_lora.train": "rank", "titan_lora.engines.receiver": "receiver"}


def tokenizer_dir() -> Path:
    """SmolLM2's tokenizer (its ids fit any Llama-3 vocabulary): the GRPO task's prompts need one."""
    return pretrained_dir(need_weights=False)


def job_config(hf_dir: Path, out: Path, steps: int, device: str) -> Path:
    """The GRPO receiver job (train_configs/gpu/smollm2_grpo_gpu.toml's settings) on the checkpoint."""
    toml = job_toml(hf_dir, tp=1) + f"""
[job]
dump_folder = "{out}"
[grpo]
enabled = true
rollouts = false
prompts_per_step = 16
group_size = 8
max_new_tokens = 8
eval_every = 0
[engine]
kind = "receiver"
[weight_sync]
enabled = true
keep_versions = 2
bucket_mb = 64
parity_every = 0
base = "verify"
[optimizer]
name = "AdamW"
lr = 2e-4
[checkpoint]
enable = false
"""
    precision = "bfloat16" if device == "cuda" else "float32"
    toml = toml.replace("[training]\nseq_len = 64\n", f"[training]\nseq_len = 128\nsteps = {steps}\nmax_norm = 1.0\n"
                        f'mixed_precision_param = "{precision}"\n')
    path = out / "job.toml"
    path.write_text(toml)
    return path


class PeakRss:
    """Samples VmHWM of every job process (ranks, receiver) until stopped: pid -> (role, peak bytes)."""

    def __init__(self, root_pid: int) -> None:
        self.root, self.peaks, self._stop = root_pid, {}, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            for proc in Path("/proc").iterdir():
                if not proc.name.isdigit():
                    continue
                try:
                    cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                    role = next((r for m, r in PROCESSES.items() if f"-m {m}" in cmd or f"{m} " in cmd), None)
                    if role is None or "torch.distributed.run" in cmd:
                        continue
                    hwm = next(x for x in (proc / "status").read_text().splitlines() if x.startswith("VmHWM:"))
                except (OSError, StopIteration):
                    continue
                self.peaks[int(proc.name)] = (role, int(hwm.split()[1]) * 1024)

    def stop(self) -> list[tuple[str, int]]:
        """(role, peak bytes) of each process seen, ranks first."""
        self._stop.set()
        self._thread.join()
        return sorted(self.peaks.values())


def run_job(args: argparse.Namespace, hf_dir: Path, out: Path) -> dict:
    """Run the job under torchrun; its figures."""
    config = job_config(hf_dir, out, args.steps, args.device)
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    if args.device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}", "-m",
           "titan_lora.train", "--job.config_file", str(config)]
    started = time.perf_counter()
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rss = PeakRss(job.pid)
    stamps, lines = {}, []
    for line in job.stdout:
        lines.append(line)
        for key, pattern in (("loaded", "loaded pretrained weights"), ("base", "sent the base weights"),
                             ("first_step", r"step\s+1/")):
            if key not in stamps and re.search(pattern, line):
                stamps[key] = time.perf_counter() - started
    code = job.wait()
    peaks = rss.stop()
    log = "".join(lines)
    (out / "job.log").write_text(log)
    if code != 0:
        sys.exit(f"the job failed ({code}); its log: {out / 'job.log'}\n{log[-4000:]}")
    sent = re.search(r"sent the base weights \((\d+) tensors\) in ([\d.]+) s", log)
    if sent is None:
        sys.exit(f"the job sent no base (the receiver must get the whole base); log: {out / 'job.log'}")
    scalars = read_scalars(str(out / "tb"))
    steady = lambda tag: [v for s, v in scalars.get(tag, []) if s >= 2]  # noqa: E731 (step 1: warm-up)
    return {"stamps": stamps, "base_tensors": int(sent.group(1)), "base_s": float(sent.group(2)),
            "peaks": peaks, "sync_ms": steady("sync/total_ms"), "step_s": steady("train/step_time_s"),
            "versions": [v for _, v in scalars.get("sync/version", [])], "wall_s": time.perf_counter() - started}


def _baseline_rank(rank: int, world: int, port: int, hf_dir: Path, device_type: str, out: Path) -> None:
    """The old way's host copy of the base on rank 0, and the link floor, on fresh ranks."""
    built, device = model_on_rank(rank, world, port, hf_dir, device_type, tp=1)
    load_base_weights(built.model, hf_dir, built.sd_adapter, built.tied)
    base_bytes = sum(p.numel() * 2 for n, p in built.model.named_parameters() if "lora_" not in n)  # bf16
    flat = torch.empty(base_bytes // 2 // world, dtype=torch.bfloat16, device=device)
    whole = torch.empty(flat.numel() * world, dtype=torch.bfloat16, device=device)
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_gather_into_tensor(whole, flat)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    floor_s = time.perf_counter() - t0
    del whole, flat
    before = status_bytes("VmRSS")
    reset_peak_rss()
    dist.barrier()
    t0 = time.perf_counter()
    state = get_model_state_dict(built.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    copy_s = time.perf_counter() - t0
    state = {k: v for k, v in state.items() if "lora_" not in k}
    held = sum(v.numel() * v.element_size() for v in state.values())
    (out / f"baseline-{rank}.json").write_text(json.dumps({"floor_s": floor_s, "copy_s": copy_s, "held": held,
                                                           "peak": status_bytes("VmHWM"), "before": before}))
    del state, built
    leave_distributed()


def run_baseline(args: argparse.Namespace, hf_dir: Path, out: Path) -> dict:
    """Rank 0's figures of the old way's host copy, and the all-gather floor."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_baseline_rank, args=(args.ranks, port, hf_dir, args.device, out), nprocs=args.ranks)
    return json.loads((out / "baseline-0.json").read_text())


def report(args: argparse.Namespace, layers: int, nbytes: int, job: dict, old: dict) -> None:
    """The figures beside the floor and the baseline, as ratios."""
    import statistics

    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    ranks = [b for r, b in job["peaks"] if r == "rank"]
    receiver = [b for r, b in job["peaks"] if r == "receiver"]
    print(f"\nbench_base_stream: Llama-3 {args.shape} shape, {layers} layers, {nbytes / 1e9:.2f} GB bf16 "
          f"checkpoint; {args.ranks} ranks ({args.device}); the receiver as the engine; {args.steps} GRPO steps")
    print(f"{'figure':58s} {'s':>8s} {'x floor':>8s} {'vs baseline':>12s}")
    print(f"{'floor: all-gather of the base bytes into rank 0':58s} {old['floor_s']:8.2f} {1.0:8.2f}")
    print(f"{'baseline: whole state dict into rank 0 host memory':58s} {old['copy_s']:8.2f} "
          f"{old['copy_s'] / old['floor_s']:8.2f} {1.0:11.2f}x")
    print(f"{'base streamed from the shards into the receiver':58s} {job['base_s']:8.2f} "
          f"{job['base_s'] / old['floor_s']:8.2f} {old['copy_s'] / job['base_s']:11.2f}x")
    print(f"  ({job['base_tensors']} tensors; the baseline only made the copy: sending it came on top)")
    print(f"{'figure':58s} {'GiB':>8s} {'x share':>8s}")
    share = nbytes / args.ranks
    print(f"{'share: checkpoint bytes / ranks':58s} {share / GiB:8.2f} {1.0:8.2f}")
    print(f"{'baseline: rank 0 peak RSS with the host copy':58s} {old['peak'] / GiB:8.2f} "
          f"{old['peak'] / share:8.2f}  (copy {old['held'] / GiB:.2f} GiB, RSS before {old['before'] / GiB:.2f})")
    print(f"{'job: largest rank peak RSS (load, stream, steps)':58s} {max(ranks) / GiB:8.2f} "
          f"{max(ranks) / share:8.2f}")
    if receiver:
        print(f"{'job: receiver peak RSS':58s} {max(receiver) / GiB:8.2f} {max(receiver) / share:8.2f}")
    stamps = job["stamps"]
    print(f"job: loaded at {stamps.get('loaded', float('nan')):.1f} s, base sent by {stamps.get('base', float('nan')):.1f}"
          f" s, step 1 at {stamps.get('first_step', float('nan')):.1f} s, done at {job['wall_s']:.1f} s after launch")
    print(f"job: versions {[int(v) for v in job['versions']]}; steps 2..{args.steps}: median step "
          f"{med(job['step_s']):.3f} s, median sync {med(job['sync_ms']):.2f} ms")


def main() -> None:
    """Write the checkpoint, run the job and the baseline, print the figures."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--layers", type=int, default=None, help="layers written (default: the shape's own)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dir", type=Path, default=None, help="where to write the checkpoint (default: tmp)")
    args = ap.parse_args()
    layers = args.layers or SHAPES[args.shape][-1]
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)  # a path that does not exist yet is created, not refused
    root = Path(tempfile.mkdtemp(prefix="bench_base_stream_", dir=args.dir))
    try:
        hf_dir = root / "ckpt"
        nbytes = write_checkpoint(hf_dir, args.shape, layers, int(5e9))
        tokenizer = tokenizer_dir()
        for name in TOKENIZER_FILES:
            if (tokenizer / name).exists():
                shutil.copy(tokenizer / name, hf_dir / name)
        job = run_job(args, hf_dir, root)
        old = run_baseline(args, hf_dir, root)
        report(args, layers, nbytes, job, old)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
