"""The GRPO GPU config (train_configs/gpu/smollm2_grpo_gpu.toml) for 3 steps on 2 GPUs through the CLI
(`pytest -m gpu`): every step trains and syncs into the receiver process over CUDA IPC, each sync acked
with the step's version and the adapter's tensor count and bytes, and nothing is left in /dev/shm once
the job exited (no CUDA IPC ref-counter file, no segment; the CUDA driver's own per-process file,
`cuda.shm.<dev>.<pid>.<n>`, is named apart). Needs SmolLM2's config and tokenizer (no
weights: random init) under $TITAN_LORA_CACHE/smollm2-135m-instruct."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dist_helpers import needs_gpus
from job_helpers import REPO, scalars
from shm_helpers import cuda_driver_files, shm_segments

STEPS = 3
GPU_GRPO = REPO / "train_configs/gpu/smollm2_grpo_gpu.toml"
ADAPTER_TENSORS = 30 * 7 * 2  # SmolLM2-135M: 30 layers, LoRA on all 7 linears, A and B


@needs_gpus(2)
def test_the_grpo_gpu_config_trains_and_syncs_every_step_into_the_receiver(tmp_path: Path) -> None:
    before = shm_segments()
    log = tmp_path / "train.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "titan_lora.train",
           "--job.config_file", str(GPU_GRPO), f"--job.dump_folder={tmp_path / 'run'}",
           f"--training.steps={STEPS}"]
    done = subprocess.run(cmd, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT, timeout=900,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, log.read_text()[-4000:]
    tags = scalars(tmp_path / "run" / "tb")
    print({k: v for k, v in tags.items() if k.startswith("sync/")})
    assert tags["sync/version"] == {s: float(s) for s in range(1, STEPS + 1)}, "one acked version per step"
    assert tags["sync/syncs"][STEPS] == STEPS + 1, "version 0 (the starting adapter) went before step 1"
    assert set(tags["sync/tensors"].values()) == {float(ADAPTER_TENSORS)}, "every ack counts every tensor"
    assert len(set(tags["sync/bytes"].values())) == 1 and min(tags["sync/bytes"].values()) > 0
    left = shm_segments() - before
    driver = cuda_driver_files(left)
    assert left - driver == set(), "the job left shared memory or CUDA IPC ref-counter files behind"
    assert len(driver) <= 3, f"more CUDA driver IPC files than the job's processes (2 ranks, receiver): {driver}"
