"""Render a run's reward curve, held-out accuracy and per-phase sync latency to one PNG.

    python scripts/plot_run.py outputs/smollm2_grpo_arith/tb --out docs/grpo_run.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SYNC_PHASES = ("sync/gather_ms", "sync/pack_ms", "sync/transfer_ms", "sync/apply_ms", "sync/total_ms")


def read_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in the TensorBoard event files under `log_dir`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    # A resumed run appends a second event file that repeats the steps after its checkpoint: the
    # later value of a step wins.
    return {tag: sorted({e.step: e.value for e in acc.Scalars(tag)}.items()) for tag in acc.Tags()["scalars"]}


def plot(series: dict[str, list[tuple[int, float]]], out: Path, title: str) -> None:
    """Three panels: reward (mean and std), held-out accuracy, sync phases."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    if "rl/reward_mean" in series:
        steps, mean = zip(*series["rl/reward_mean"])
        ax.plot(steps, mean, label="reward mean")
        if "rl/reward_std" in series:
            ax.plot(*zip(*series["rl/reward_std"]), label="reward std", alpha=0.6)
    elif "train/loss" in series:
        ax.plot(*zip(*series["train/loss"]), label="loss")
    ax.set(title="reward per step", xlabel="step")
    ax.legend()
    ax = axes[1]
    if "eval/accuracy" in series:
        ax.plot(*zip(*series["eval/accuracy"]), marker="o")
    ax.set(title="held-out accuracy (greedy)", xlabel="step", ylim=(0, 1))
    ax = axes[2]
    for tag in SYNC_PHASES:
        if tag in series:
            ax.plot(*zip(*series[tag]), label=tag.removeprefix("sync/"))
    ax.set(title="weight sync latency per phase", xlabel="step", ylabel="ms", yscale="log")
    ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    """Parse arguments and write the PNG."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log_dir", help="the run's TensorBoard folder (<dump_folder>/tb)")
    ap.add_argument("--out", default="run.png")
    ap.add_argument("--title", default="")
    args = ap.parse_args()
    series = read_scalars(args.log_dir)
    if not series:
        sys.exit(f"no TensorBoard scalars under {args.log_dir}")
    plot(series, Path(args.out), args.title or args.log_dir)
    print(f"wrote {args.out} ({len(series)} series)")


if __name__ == "__main__":
    main()
