"""The GRPO loop benchmark: the main job in the synchronous loop (the baseline: what alternating trainers
do) and in the async loop, same seed and steps, one after the other on this machine, in one run.

    python scripts/bench_loop.py                      # the main job: 2 ranks, 40 steps, seeds 0 and 1
    python scripts/bench_loop.py --nproc 1 --steps 12 --seeds 0 --eval-every 0
    python scripts/bench_loop.py --nproc 1 --pin ...  # trainer on core 0, the engine's processes on core 1
    python scripts/bench_loop.py --steps 4 --seeds 0  # a smoke run

Per run it prints steps per hour (over steps 2..N: step 1 includes the engine's warm-up), the held-out
accuracy at the last step, and each phase's mean per step: the trainer's own work (`phase/train_s`,
without the wait for samples), the wait for samples, the sync, and the engine's busy and idle time.
The floor is the ideal overlap bound, from the synchronous run's own phases:
    ideal = sync step time / max(train time, rollout time)
(a loop cannot step faster than its slower side); async's speed-up is printed as a fraction of it.
Time spent in held-out evaluation is in both loops' step times alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from plot_run import read_scalars

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "train_configs/smollm2_grpo_arith.toml"


class CorePinner:
    """Keeps every thread of the job on its side's cores until stopped: the trainer's ranks (and their
    threads: rank 0's producer too) on cores 0..N-1, the whole engine process tree (API server, engine core,
    its kernels) on core N. A `taskset` of the job alone would leave the engine's processes, which inherit
    rank 0's mask, on the trainer's core, and vLLM binds only its kernel threads."""

    def __init__(self, root: int, nproc: int) -> None:
        self.root, self.trainer, self.engine = root, set(range(nproc)), {nproc}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _cores(self, proc) -> set[int]:  # noqa: ANN001 (a psutil.Process)
        for p in [proc, *proc.parents()]:
            if p.pid == self.root:
                return self.trainer
            if "titan_lora.engines" in " ".join(p.cmdline()):
                return self.engine
        return self.trainer

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(0.25):
            try:
                procs = psutil.Process(self.root).children(recursive=True)
            except psutil.NoSuchProcess:
                return
            for proc in procs:
                try:
                    cores = self._cores(proc)
                    for thread in proc.threads():
                        if os.sched_getaffinity(thread.id) != cores:
                            os.sched_setaffinity(thread.id, cores)
                except (psutil.Error, OSError):
                    continue  # it ended meanwhile

    def stop(self) -> None:
        """Stop pinning (the job has ended)."""
        self._stop.set()
        self._thread.join()


def run_job(loop: str, seed: int, args: argparse.Namespace, out: Path) -> dict[str, float]:
    """One run of the main job; its figures from its TensorBoard events."""
    dump = out / f"{loop}-seed{seed}-n{args.nproc}{'-pinned' if args.pin else ''}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", "-m", "titan_lora.train",
           "--job.config_file", str(CONFIG), f"--job.dump_folder={dump}", f"--grpo.loop={loop}",
           f"--grpo.seed={seed}", f"--training.steps={args.steps}", "--checkpoint.no-enable",
           f"--grpo.eval_every={args.eval_every}", "--lora.export_dir="]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.pin:  # the trainer's ranks one core each (0..N-1), the engine's kernels the next core
        env |= {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": str(args.nproc)}
    started = time.monotonic()
    with open(out / f"{dump.name}.log", "w") as log:
        print(f"  {loop} loop, seed {seed}, {args.nproc} rank(s), {args.steps} steps{', pinned' if args.pin else ''}:"
              f" {' '.join(cmd)}", flush=True)
        job = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
        pinner = CorePinner(job.pid, args.nproc) if args.pin else None
        rc = job.wait()
        if pinner is not None:
            pinner.stop()
    if rc:
        sys.exit(f"the {loop} run failed (rc {rc}); see {out / f'{dump.name}.log'}")
    tags = {tag: dict(points) for tag, points in read_scalars(str(dump / "tb")).items()}
    steps = range(2, args.steps + 1)
    mean = lambda tag: statistics.fmean(tags[tag][s] for s in steps)  # noqa: E731
    step_s = mean("train/step_time_s")
    acc = tags.get("eval/accuracy", {})
    return {
        "wall_s": time.monotonic() - started, "step_s": step_s, "steps_per_hour": 3600 / step_s,
        "train_s": mean("phase/train_s"), "wait_s": mean("phase/rollout_wait_s"), "sync_s": mean("phase/sync_s"),
        "busy_s": mean("phase/engine_busy_s"), "idle_s": mean("phase/engine_idle_s"),
        "tokens_per_s": mean("phase/gen_tokens_per_s"), "staleness": mean("rl/staleness_mean"),
        "acc_first": acc.get(0, float("nan")), "acc_last": acc.get(args.steps, float("nan")),
    }


def report(seed: int, sync: dict[str, float], overlap: dict[str, float]) -> dict[str, float]:
    """Print one seed's table; returns the ratios."""
    print(f"\nseed {seed}: per step, mean over steps 2..N")
    print(f"  {'':28}{'sync (baseline)':>18}{'async':>12}")
    rows = [("steps per hour", "steps_per_hour", "{:.0f}"), ("step time, s", "step_s", "{:.2f}"),
            ("trainer's own work, s", "train_s", "{:.2f}"), ("waiting for samples, s", "wait_s", "{:.2f}"),
            ("sync, s", "sync_s", "{:.3f}"), ("engine busy, s", "busy_s", "{:.2f}"),
            ("engine idle, s", "idle_s", "{:.2f}"), ("generated tokens / s", "tokens_per_s", "{:.1f}"),
            ("sample staleness", "staleness", "{:.2f}"), ("held-out acc, first", "acc_first", "{:.3f}"),
            ("held-out acc, last", "acc_last", "{:.3f}")]
    for label, key, fmt in rows:
        print(f"  {label:28}{fmt.format(sync[key]):>18}{fmt.format(overlap[key]):>12}")
    rollout_s = sync["wait_s"]  # in the synchronous loop the trainer waits exactly for the rollouts
    ideal = sync["step_s"] / max(sync["train_s"], rollout_s)
    speedup = overlap["steps_per_hour"] / sync["steps_per_hour"]
    print(f"  speed-up {speedup:.2f}x over the synchronous loop; ideal overlap bound (floor) {ideal:.2f}x "
          f"= {sync['step_s']:.2f} / max(train {sync['train_s']:.2f}, rollout {rollout_s:.2f}); "
          f"async reaches {speedup / ideal:.0%} of it; held-out accuracy {overlap['acc_last'] - sync['acc_last']:+.3f}")
    return {"speedup": speedup, "ideal": ideal, "of_ideal": speedup / ideal}


def main() -> None:
    """Run both loops for every seed and print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="trainer ranks (CPU: one core each)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--eval-every", type=int, default=10, help="held-out eval period (0: never)")
    parser.add_argument("--pin", action="store_true",
                        help="one core per trainer rank and the next one for the engine's processes (every thread "
                             "pinned as it appears, OMP_NUM_THREADS=1, VLLM_CPU_OMP_THREADS_BIND); needs nproc + 1 cores")
    parser.add_argument("--out", type=Path, default=REPO / "outputs/bench_loop")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ratios = []
    for seed in args.seeds:
        sync = run_job("sync", seed, args, args.out)
        overlap = run_job("async", seed, args, args.out)
        ratios.append(report(seed, sync, overlap))
    if len(ratios) > 1:
        print("\nover seeds: speed-up " + ", ".join(f"{r['speedup']:.2f}x" for r in ratios)
              + "; of the ideal bound " + ", ".join(f"{r['of_ideal']:.0%}" for r in ratios))


if __name__ == "__main__":
    main()
