"""titan_lora's run sections as torchtitan 0.3.0's configs: the optimizer and LR schedule it builds step as
0.2.2's did, and `selective_ac_option = N` keeps checkpointing every N-th block (0.3.0 dropped it)."""

from __future__ import annotations

import importlib.metadata

import pytest

if not importlib.metadata.version("torchtitan").startswith("0.3."):
    pytest.skip("these tests need torchtitan 0.3.x (PYTHONPATH overlay)", allow_module_level=True)

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from titan_lora.config import JobConfig
from titan_lora.titan.configs import (
    EveryNthBlockAC, titan_ac, titan_compile, titan_lr_scheduler, titan_optimizer, titan_parallelism,
)


def _job(**sections) -> JobConfig:
    job = JobConfig()
    for section, values in sections.items():
        for key, value in values.items():
            setattr(getattr(job, section), key, value)
    return job


def test_the_optimizer_and_schedule_step_the_adapters_as_configured() -> None:
    job = _job(optimizer={"lr": 0.5, "weight_decay": 0.0, "implementation": "foreach"},
               lr_scheduler={"warmup_steps": 2, "decay_type": "linear", "min_lr_factor": 0.0},
               training={"steps": 4})
    model = nn.Sequential(nn.Linear(3, 2))
    optimizers = titan_optimizer(job.optimizer).build(model_parts=[model])
    schedulers = titan_lr_scheduler(job.lr_scheduler).build(optimizers=optimizers, training_steps=4)
    group = optimizers.optimizers[0].param_groups[0]
    assert type(optimizers.optimizers[0]) is torch.optim.AdamW and group["betas"] == (0.9, 0.95)
    assert group["foreach"] is True and group["weight_decay"] == 0.0
    lrs = []
    for _ in range(4):
        lrs.append(optimizers.optimizers[0].param_groups[0]["lr"])
        model(torch.ones(1, 3)).sum().backward()
        optimizers.step()
        schedulers.step()
    assert lrs[0] < lrs[1] == pytest.approx(0.5) and lrs[-1] < lrs[1], lrs  # warm-up, then linear decay


@pytest.mark.parametrize("mode, option, wrapped", [
    ("none", "2", None), ("full", "2", [0, 1, 2, 3]), ("selective", "2", [1, 3]), ("selective", "3", [2]),
])
def test_activation_checkpointing_wraps_the_blocks_0_2_2_did(mode: str, option: str, wrapped) -> None:
    config = titan_ac(_job(activation_checkpoint={"mode": mode, "selective_ac_option": option}).activation_checkpoint)
    if wrapped is None:
        assert config is None
        return
    model = nn.Module()
    model.layers = nn.ModuleDict({str(i): nn.Linear(2, 2) for i in range(4)})
    config.build(dump_folder="").apply(model)
    assert [i for i in range(4) if isinstance(model.layers[str(i)], CheckpointWrapper)] == wrapped
    assert isinstance(titan_ac(_job(activation_checkpoint={"mode": "selective", "selective_ac_option": "5"})
                               .activation_checkpoint), EveryNthBlockAC.Config)


def test_compile_and_parallelism_keep_their_values_on_the_partial_dtensor_backend() -> None:
    job = _job(compile={"enable": True}, parallelism={"tensor_parallel_degree": 2, "data_parallel_shard_degree": 2})
    assert (titan_compile(job.compile).enable, titan_compile(job.compile).components) == (True, ["model"])
    parallelism = titan_parallelism(job.parallelism)
    assert (parallelism.tensor_parallel_degree, parallelism.data_parallel_shard_degree) == (2, 2)
    assert parallelism.spmd_backend == "partial_dtensor"
