"""The Tinker-compatible service's costs, in one run: a training call through the SDK and the service against
the same step run in-process (what a TOML job runs: the same model, slots and mixed step, no HTTP, no
queue), the time from `save_weights_for_sampler` returning to the first sample of that version, and the
total throughput of 1, 2 and 4 clients training at once.

    python scripts/bench_service.py [--steps 8] [--clients 1 2 4]

SmolLM2-135M (pretrained), rank 8 LoRA on every linear, one datum of 64 tokens per call, AdamW; the service
is `titan-lora serve train_configs/smollm2_service.toml` with its embedded vLLM engine (CPU here).
Floor and baseline: the same step in-process, measured while the service's engine idles beside it (on a
small CPU machine the engine process takes its share of the cores; the step with no engine at all is printed
too); overhead goal <= 15%. Save-to-sample has no baseline here (Tinker publishes no such figure).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
KEY = "tml-local-dev"
TOKENS = 64


def datum_arrays() -> tuple[list[int], list[int], list[float]]:
    """One fixed datum: 64 token ids, their targets, weight 1 on the last half."""
    tokens = [(97 * i + 13) % 2000 + 100 for i in range(TOKENS + 1)]
    return tokens[:-1], tokens[1:], [0.0] * (TOKENS // 2) + [1.0] * (TOKENS // 2)


def in_process_ms(steps: int) -> float:
    """Median ms of forward_backward + optim_step run in-process on the service's own parts."""
    import numpy as np
    import torch

    from titan_lora.service.main import build_slots, service_job
    from titan_lora.service.slots import AdamStep, SlotSpec
    from titan_lora.service.step import Limits, Work, run_step
    from titan_lora.service.wire import Datum, ForwardBackward
    from titan_lora.trainer.distributed import init_distributed
    from titan_lora.trainer.job_config import load_job

    cpu = torch.device("cpu")
    init_distributed(cpu)
    cfg, resolved = load_job(["--job.config_file", str(ROOT / "train_configs/smollm2_service.toml")])
    built, slots, _ = build_slots(service_job(cfg), resolved, cpu)
    slots.claim(0, SlotSpec(rank=8))
    tokens, targets, weights = datum_arrays()
    request = ForwardBackward("m", 1, "cross_entropy", {}, False, [Datum(
        np.asarray(tokens), {"target_tokens": np.asarray(targets), "weights": np.asarray(weights, np.float32)})])
    limits = Limits(resolved.shape.vocab_size, 2048, 65536)
    times = []
    for _ in range(steps + 2):
        t0 = time.perf_counter()
        run_step(built.model, [Work(0, request)], slots.count, limits, cpu)
        slots.step(0, AdamStep(learning_rate=1e-4))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[2:])


def start_service(*overrides: str) -> tuple[subprocess.Popen, str]:
    """`titan-lora serve` on a free port; its URL once it serves."""
    proc = subprocess.Popen([sys.executable, "-m", "titan_lora.cli", "serve", "train_configs/smollm2_service.toml",
                             "--service.port", "0", "--job.dump_folder", "outputs/bench_service", *overrides], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        found = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
        if found:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, found.group(1)
    raise SystemExit("the service did not start")


def client_steps(url: str, steps: int, out: list[float]) -> None:
    """One client: `steps` forward_backward + optim_step calls; each call's ms appended to `out`."""
    import tinker
    from tinker import types

    tokens, targets, weights = datum_arrays()
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens),
                        loss_fn_inputs={"target_tokens": targets, "weights": weights})
    with tinker.ServiceClient(base_url=url, api_key=KEY) as sdk:
        client = sdk.create_lora_training_client(base_model=NAME, rank=8).result()
        for _ in range(steps + 2):
            t0 = time.perf_counter()
            backward = client.forward_backward([datum], "cross_entropy")
            client.optim_step(types.AdamParams(learning_rate=1e-4)).result()
            backward.result()
            out.append((time.perf_counter() - t0) * 1e3)
        del out[-steps - 2:-steps]  # the first two calls: warm-up


def save_to_sample_ms(url: str, repeats: int) -> tuple[float, float]:
    """Median ms of save_weights_for_sampler, and from its return to the first sample of that version."""
    import tinker
    from tinker import types

    tokens, _, _ = datum_arrays()
    saves, firsts = [], []
    with tinker.ServiceClient(base_url=url, api_key=KEY) as sdk:
        client = sdk.create_lora_training_client(base_model=NAME, rank=8).result()
        for i in range(repeats):
            t0 = time.perf_counter()
            path = client.save_weights_for_sampler(f"bench-{i}").result().path
            t1 = time.perf_counter()
            sdk.create_sampling_client(model_path=path).result().sample(
                types.ModelInput.from_ints(tokens[:16]), num_samples=1,
                sampling_params=types.SamplingParams(max_tokens=1, temperature=0.0)).result()
            saves.append((t1 - t0) * 1e3)
            firsts.append((time.perf_counter() - t1) * 1e3)
    return statistics.median(saves), statistics.median(firsts)


def main() -> None:
    """Print the figures and their ratios."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    alone = in_process_ms(args.steps)
    proc, url = start_service("--weight_sync.no-enabled")
    try:
        no_engine: list[float] = []
        client_steps(url, args.steps, no_engine)
    finally:
        proc.terminate()
        proc.wait(60)
    proc, url = start_service()
    try:
        local = in_process_ms(args.steps)  # beside the service's idle engine, as the service's own steps run
        one: list[float] = []
        client_steps(url, args.steps, one)
        save, first = save_to_sample_ms(url, 3)
        throughput = {}
        for count in args.clients:
            per_client: list[list[float]] = [[] for _ in range(count)]
            threads = [threading.Thread(target=client_steps, args=(url, args.steps, per_client[i]))
                       for i in range(count)]
            t0 = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            throughput[count] = count * (args.steps + 2) / (time.perf_counter() - t0)
    finally:
        proc.terminate()
        proc.wait(60)
    through = statistics.median(one)
    print(f"forward_backward + optim_step, 1 datum of {TOKENS} tokens, rank 8:")
    print(f"  through the SDK and the service  {through:8.1f} ms (median of {args.steps})")
    print(f"  in-process (floor, baseline)     {local:8.1f} ms   service / in-process = {through / local:.2f}x "
          "(goal <= 1.15x)")
    print(f"  in-process, no engine running    {alone:8.1f} ms   (the idle engine's share of the CPU: "
          f"{local / alone:.2f}x)")
    print(f"  the service with no engine       {statistics.median(no_engine):8.1f} ms   service / in-process = "
          f"{statistics.median(no_engine) / alone:.2f}x (HTTP, queue, protobuf, one rank under torchrun)")
    print(f"save_weights_for_sampler           {save:8.1f} ms (sync of one slot + parity probe, median of 3)")
    print(f"  its return -> first sample       {first:8.1f} ms (max_tokens 1)")
    base = throughput[args.clients[0]]
    for count, rate in throughput.items():
        print(f"{count} client(s) at once: {rate:6.2f} calls/s in all ({rate / base:.2f}x {args.clients[0]})")


if __name__ == "__main__":
    main()
