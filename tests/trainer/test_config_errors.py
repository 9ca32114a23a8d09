"""Bad configs fail while the config is read, before any model is built, naming the key and the fix."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from model_helpers import DEBUG_LORA, job_config_from

REPO = Path(__file__).resolve().parents[2]


def _lora(extra: str) -> str:
    return DEBUG_LORA.replace("[lora]\n", f"[lora]\n{extra}\n")


def _sync(extra: str, enabled: bool = True, engine: str = "") -> str:
    return DEBUG_LORA + f"[engine]\n{engine}\n[weight_sync]\nenabled = {str(enabled).lower()}\n{extra}\n"


def _training(extra: str) -> str:
    return DEBUG_LORA.replace("[training]\n", f"[training]\n{extra}\n")


WIDE_TARGETS = '["wq", "wo", "w1", "w2", "w3"]'
GRPO_WITH_ROLLOUTS = "[grpo]\nenabled = true\nprompts_per_step = 2\ngroup_size = 2\n"


def test_the_reference_config_is_valid(tmp_path) -> None:
    cfg = job_config_from(_lora(f'export_dir = "{tmp_path}/not/yet/there"'))
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.target_modules) == (8, 16, "all-linear")
    assert cfg.model.converters == ["lora"]
    assert cfg.lora.export_dir == f"{tmp_path}/not/yet/there"


def test_a_relative_export_dir_is_under_the_dump_folder(tmp_path) -> None:
    cfg = job_config_from(_lora('export_dir = "peft"'), f"--job.dump_folder={tmp_path}/run")
    assert cfg.lora.export_dir == f"{tmp_path}/run/peft"


def test_the_adapter_is_exported_under_the_dump_folder_by_default_and_empty_turns_it_off(tmp_path) -> None:
    assert "export_dir" not in DEBUG_LORA
    run = f"--job.dump_folder={tmp_path}/run"
    assert job_config_from(DEBUG_LORA, run).lora.export_dir == f"{tmp_path}/run/adapter"
    assert job_config_from(_lora('export_dir = ""'), run).lora.export_dir == ""
    assert job_config_from(DEBUG_LORA, run, "--lora.export_dir=").lora.export_dir == ""


def test_sglang_serves_rollouts() -> None:
    cfg = job_config_from(_sync("", engine='kind = "sglang"\nurl = "http://sglang:30000"') + GRPO_WITH_ROLLOUTS)
    assert (cfg.engine.kind, cfg.grpo.enabled, cfg.grpo.rollouts) == ("sglang", True, True)


def test_hf_target_names_are_valid() -> None:
    cfg = job_config_from(DEBUG_LORA.replace('"all-linear"', '["q_proj", "wv"]'))
    assert cfg.lora.target_modules == ["q_proj", "wv"]


BAD = {
    "rank zero": (DEBUG_LORA.replace("rank = 8", "rank = 0"), ["[lora] rank", "got 0", "rank = 16"]),
    "rank negative": (DEBUG_LORA.replace("rank = 8", "rank = -4"), ["[lora] rank", "got -4"]),
    "unknown lora key": (DEBUG_LORA.replace("rank = 8", "rnak = 8"), ["[lora]", "'rnak'", "did you mean 'rank'"]),
    "unknown converter": (
        DEBUG_LORA.replace('converters = ["lora"]', 'converters = ["lroa"]'),
        ["[model] converters", "'lroa'", "lora"],
    ),
    "empty target list": (DEBUG_LORA.replace('"all-linear"', "[]"), ["[lora] target_modules", "all-linear"]),
    "target string other than all-linear": (
        DEBUG_LORA.replace('"all-linear"', '"all_linear"'), ["[lora] target_modules", "'all_linear'", "all-linear"],
    ),
    "dropout": (_lora("dropout = 1.0"), ["[lora] dropout", "[0, 1)"]),
    "adapter dtype": (_lora('dtype = "float64"'), ["[lora] dtype", "'float64'", "bfloat16"]),
    "export_dir below a file": (_lora(f'export_dir = "{__file__}/adapter"'), ["[lora] export_dir", __file__]),
    "target modules matching nothing": (
        DEBUG_LORA.replace('"all-linear"', '["wq", "qproj"]'), ["[lora] target_modules", "'qproj'", "all-linear"],
    ),
    "export_dir under /proc": (_lora('export_dir = "/proc/titan_lora_export"'), ["[lora] export_dir", "/proc"]),
    "on_nonfinite, even without sync": (
        _training('on_nonfinite = "skip"'), ["[training] on_nonfinite", "'skip'", "rollback"],
    ),
    "rollback without checkpoints": (
        _training('on_nonfinite = "rollback"'), ["[training] on_nonfinite", "[checkpoint] enable = true"],
    ),
    "rollout timeout": (_sync("rollout_timeout_s = 0"), ["[weight_sync] rollout_timeout_s", "> 0"]),
    "health timeout": (_sync("health_timeout_s = -1"), ["[weight_sync] health_timeout_s", "> 0"]),
    "engine start timeout": (_sync("engine_start_timeout_s = 0"), ["[weight_sync] engine_start_timeout_s"]),
    "retire timeout": (_sync("retire_timeout_s = 0"), ["[weight_sync] retire_timeout_s", "> 0"]),
    "engine restarts": (_sync("engine_restarts = -1"), ["[weight_sync] engine_restarts", ">= 0"]),
    "unknown engine kind": (
        _sync("", engine='kind = "vlm"'), ["[engine] kind = 'vlm'", "receiver, sglang, vllm, vllm-disk"],
    ),
    "sglang without a url": (
        _sync("", engine='kind = "sglang"'), ["[engine] kind = 'sglang' attaches to a running server", "url = "],
    ),
    "rollouts from the receiver": (
        _sync("", engine='kind = "receiver"') + GRPO_WITH_ROLLOUTS,
        ["[engine] kind = 'receiver' runs no rollouts", "[grpo] rollouts = false"],
    ),
    "targets sglang cannot fuse": (
        _sync("", engine='kind = "sglang"\nurl = "http://sglang:30000"').replace('"all-linear"', '["wq", "wk"]'),
        ["[engine] kind = 'sglang'", "['k_proj', 'q_proj']", "add the missing modules to [lora] target_modules"],
    ),
    "pause mode": (_sync("", engine='pause_mode = "stop"'), ["[engine] pause_mode = 'stop'", "in_place"]),
    "engine port": (_sync("", engine="port = 70000"), ["[engine] port must be in [0, 65535], got 70000", "0 to pick"]),
    "unknown transport": (
        _sync("", engine='transport = "rdma"'), ["[engine] transport = 'rdma'", "cuda_ipc, nccl, shm, tcp", '"auto"'],
    ),
    "a transport for a kind that sends no buckets": (
        _sync("", engine='kind = "sglang"\nurl = "http://sglang:30000"\ntransport = "tcp"'),
        ["[engine] transport = 'tcp'", "kind 'sglang' does not send buckets", "remove the key"],
    ),
    "tcp port": (_sync("", engine="tcp_port = 70000"), ["[engine] tcp_port must be in [0, 65535], got 70000", "0 to pick"]),
    "tcp host that no engine can connect to": (
        _sync("", engine='tcp_host = "0.0.0.0"'), ["[engine] tcp_host = '0.0.0.0'", "as the engine sees it"],
    ),
    "a key that moved to [engine]": (
        _sync('engine_url = "http://e:8000"'), ["[weight_sync] engine_url has moved: use [engine] url"],
    ),
    "the emitter key that became the engine kind": (
        _sync('emitter = "disk"'), ["[weight_sync] emitter has moved", '"vllm-disk" for emitter = "disk"'],
    ),
    "on_nonfinite in its old section": (
        _sync('on_nonfinite = "stop"'), ["[weight_sync] on_nonfinite has moved: use [training] on_nonfinite"],
    ),
    "bucket larger than /dev/shm": (
        _sync("bucket_mb = 100000000"),
        ["[weight_sync] bucket_mb = 100000000", "/dev/shm", "lower bucket_mb"],
    ),
    "rank above vLLM's largest": (  # 544: within the 135M model's q, o and FFN linears (576 and up)
        _sync("").replace("rank = 8", "rank = 544").replace('"all-linear"', WIDE_TARGETS).replace(
            'flavor = "debug"', 'flavor = "135M"'), ["[lora] rank = 544", "512"],
    ),
    "pipeline parallelism": (
        DEBUG_LORA + "[parallelism]\npipeline_parallel_degree = 2\n",
        ["[parallelism] pipeline_parallel_degree is torchtitan 0.2.2's key", "data (FSDP/HSDP) and tensor "
         "parallelism only; delete the line"],
    ),
    "loss parallelism": (
        DEBUG_LORA + "[parallelism]\ntensor_parallel_degree = 2\ndisable_loss_parallel = false\n",
        ["tensor_parallel_degree = 2 with disable_loss_parallel = false asks for loss parallelism",
         "remove the key"],
    ),
    "SFT data that is missing": (
        DEBUG_LORA + '[data]\npath = "/nonexistent/sft.jsonl"\n',
        ["[data] path = '/nonexistent/sft.jsonl' does not exist", "name a JSONL file"],
    ),
    "SFT data without completions": (
        DEBUG_LORA + f'[data]\npath = "{__file__}"\n', [f"[data] path = '{__file__}': Extra data: line 1", 'each line needs {"prompt": ..., "completion": ...}'],
    ),
    "parallel degrees that do not fit the ranks": (
        DEBUG_LORA + "[parallelism]\ntensor_parallel_degree = 4\ndisable_loss_parallel = true\n",
        ["[parallelism] does not fit 1 ranks", "lower the degrees or launch more ranks"],
    ),
    "context parallelism": (
        DEBUG_LORA + "[parallelism]\ncontext_parallel_degree = 2\n",
        ["[parallelism] context_parallel_degree is torchtitan 0.2.2's key", "delete the line"],
    ),
    "unknown loop": (_sync("", engine='url = "http://e:8000"') + GRPO_WITH_ROLLOUTS + 'loop = "overlap"\n',
                     ["[grpo] loop = 'overlap'", '"sync" or "async"']),
    "async spelled as in prose": (_sync("") + GRPO_WITH_ROLLOUTS + "async = true\n",
                                  ["[grpo] async = true", 'write loop = "async"']),
    "async without rollouts": (_sync("", engine='url = "http://e:8000"') + GRPO_WITH_ROLLOUTS
                               + 'loop = "async"\nrollouts = false\n', ["[grpo] rollouts = true"]),
    "async keep_versions written too small": (
        _sync("keep_versions = 3", engine='url = "http://e:8000"') + GRPO_WITH_ROLLOUTS
        + 'loop = "async"\nmax_staleness = 2\n',
        ["[weight_sync] keep_versions = 3 must be >= [grpo] max_staleness + 2 (async loop) = 4", "leave it out"],
    ),
    "clip_eps, removed": (_sync("") + GRPO_WITH_ROLLOUTS + "clip_eps = 0.2\n",
                          ["[grpo] clip_eps was removed", "never bound", "Delete the line"]),
    "an engine url that is no address": (_sync("", engine='url = "not a url"'),
                                         ["[engine] url: 'not a url' is not an engine address", "http://host:port"]),
    "an engine url with a port that is no number": (_sync("", engine='url = "http://e:port"'),
                                                    ["[engine] url: 'http://e:port' is not an engine address"]),
    "more prompts per step than training problems": (
        DEBUG_LORA + "[grpo]\nenabled = true\nrollouts = false\nprompts_per_step = 8\ntrain_size = 4\n",
        ["[grpo] prompts_per_step = 8 is more than train_size = 4", "raise train_size"]),
    "rank above the model's dimensions": (
        DEBUG_LORA.replace("rank = 8", "rank = 100"),
        ["[lora] rank = 100 is above the model's dimensions", "use a rank of at most"]),
    "stale weight cap below 1": (_sync("") + GRPO_WITH_ROLLOUTS + "stale_weight_cap = 0.5\n",
                                 ["[grpo] stale_weight_cap must be >= 1, got 0.5"]),
}


def test_tcp_buckets_need_no_shared_memory_but_must_fit_host_memory() -> None:
    host_mb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2**20
    fits = f"bucket_mb = {host_mb // 2}"  # two buckets: all of host memory, more than /dev/shm holds
    cfg = job_config_from(_sync(fits, engine='transport = "tcp"\ntcp_host = "127.0.0.1"'))
    assert (cfg.engine.transport, cfg.engine.tcp_host, cfg.engine.tcp_port) == ("tcp", "127.0.0.1", 0)
    remote = job_config_from(_sync(fits, engine='url = "http://192.0.2.7:8000"'))
    assert remote.engine.transport == "auto", "auto takes tcp for a remote engine: /dev/shm is not sized"
    for engine in ('transport = "tcp"', 'url = "http://192.0.2.7:8000"',
                   'transport = "nccl"\nnccl_backend = "gloo"'):
        with pytest.raises(ValueError) as err:
            job_config_from(_sync("bucket_mb = 100000000", engine=engine))
        assert str(err.value).startswith("[weight_sync] bucket_mb = 100000000: the emitter double-buffers, "
                                         "which needs 200000000 MiB of host memory for transport ")
        assert str(err.value).endswith(f"this host has {host_mb} MiB; lower bucket_mb to at most {host_mb // 2} "
                                       "(the default is 32)")


def test_cuda_ipc_on_a_trainer_without_cuda_is_refused_when_read(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from titan_lora.transfer.transports.cuda_ipc import CudaIpcBuffer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r'transport = "cuda_ipc" shares GPU memory.*no CUDA device: use "auto"'):
        job_config_from(_sync("", engine='transport = "cuda_ipc"'))
    with pytest.raises(ValueError, match=r"trainer's device is cpu: set \[engine\] transport = \"auto\""):
        CudaIpcBuffer(64, torch.device("cpu"))


def test_nccl_on_a_trainer_without_cuda_needs_the_gloo_fallback_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from titan_lora.transfer.transports.nccl import NcclBuffer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r'transport = "nccl" sends GPU memory.*nccl_backend = "gloo"'):
        job_config_from(_sync("", engine='transport = "nccl"'))
    cfg = job_config_from(_sync("", engine='transport = "nccl"\nnccl_backend = "gloo"'))
    assert (cfg.engine.transport, cfg.engine.nccl_backend) == ("nccl", "gloo")
    with pytest.raises(ValueError, match=r"nccl_backend = 'mpi': use nccl or gloo"):
        job_config_from(_sync("", engine='transport = "nccl"\nnccl_backend = "mpi"'))
    with pytest.raises(ValueError, match=r'trainer\'s device is cpu: on a CPU trainer set \[engine\] nccl_backend = "gloo"'):
        NcclBuffer(64, torch.device("cpu"), backend="nccl")


def test_an_engine_started_here_on_an_untested_vllm_is_refused_when_read(monkeypatch) -> None:
    from titan_lora.transfer.vllm_release import ALLOW_UNTESTED_ENV, FAKE_VERSION_ENV

    monkeypatch.setenv(FAKE_VERSION_ENV, "0.33.0")
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(ValueError, match=r"\[engine\] kind = 'vllm' starts its engine on this host: "
                                         r"vLLM 0\.33\.0 is installed, but .* supports only vLLM 0\.32\.x.*"
                                         r"pip install torch==2\.13\.0 vllm==0\.32\.0"):
        job_config_from(_sync(""))
    job_config_from(_sync("", engine='url = "http://e:8000"'))  # attached: that engine checks its own vLLM
    job_config_from(_sync("", engine='kind = "receiver"'))  # no vLLM in it
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    assert job_config_from(_sync("")).engine.kind == "vllm", "the opt-in lets the engine start"


@pytest.mark.parametrize(("loop", "staleness", "keep"), [("async", 1, 3), ("async", 3, 5), ("sync", 2, 3)])
def test_keep_versions_left_out_is_derived_from_the_loop_and_max_staleness(loop: str, staleness: int,
                                                                           keep: int) -> None:
    grpo = GRPO_WITH_ROLLOUTS + f'loop = "{loop}"\nmax_staleness = {staleness}\n'
    cfg = job_config_from(_sync("", engine='url = "http://e:8000"') + grpo)
    assert cfg.weight_sync.keep_versions == keep
    written = job_config_from(_sync(f"keep_versions = {keep + 2}", engine='url = "http://e:8000"') + grpo)
    assert written.weight_sync.keep_versions == keep + 2, "a value the user wrote is kept when it is enough"


@pytest.mark.parametrize("flag", ["--weight_sync.keep_versions", "--weight-sync.keep-versions"])
def test_keep_versions_written_as_an_override_in_either_spelling_is_checked_not_derived(flag: str) -> None:
    grpo = GRPO_WITH_ROLLOUTS + 'loop = "async"\n'
    with pytest.raises(ValueError, match=r"keep_versions = 2 must be >= \[grpo\] max_staleness \+ 2"):
        job_config_from(_sync("", engine='url = "http://e:8000"') + grpo, flag, "2")


@pytest.mark.parametrize("case", list(BAD))
def test_bad_config_is_rejected_when_read(case: str) -> None:
    toml, must_mention = BAD[case]
    with pytest.raises(ValueError) as err:
        job_config_from(toml)
    message = str(err.value)
    for fragment in must_mention:
        assert fragment in message, f"{case}: {fragment!r} missing from {message!r}"


def test_cli_exits_2_with_the_message_on_stderr(tmp_path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(DEBUG_LORA.replace("rank = 8", "rank = 0"))
    dump = tmp_path / "dump"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "titan_lora.train", "--job.config_file", str(bad), "--job.dump_folder", str(dump)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "config error: [lora] rank must be a positive integer, got 0; try rank = 16" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not dump.exists(), "nothing should be built or written for a bad config"


def test_the_engine_and_weight_sync_keys_parse_with_their_defaults() -> None:
    cfg = job_config_from(_sync(""))
    ws, engine = cfg.weight_sync, cfg.engine
    assert (cfg.training.on_nonfinite, ws.parity_gate, ws.rollout_timeout_s, ws.health_timeout_s,
            ws.engine_start_timeout_s, ws.engine_restarts) == ("stop", False, 600.0, 10.0, 600.0, 3)
    assert (engine.kind, engine.url, engine.port, engine.api_key, engine.pause_mode) == ("vllm", "", 0, "", "none")
    toml = _training('on_nonfinite = "rollback"') + "[weight_sync]\nparity_gate = true\n[checkpoint]\nenable = true\n"
    cfg = job_config_from(toml)
    assert (cfg.training.on_nonfinite, cfg.weight_sync.parity_gate) == ("rollback", True)
    attached = job_config_from(_sync("", engine='kind = "vllm-disk"\nurl = "http://e:8000"\napi_key = "k"')).engine
    assert (attached.kind, attached.url, attached.api_key) == ("vllm-disk", "http://e:8000", "k")


def test_the_timing_receiver_takes_any_rank_the_model_can() -> None:
    wide = _sync("", engine='kind = "receiver"').replace("rank = 8", "rank = 544").replace('"all-linear"', WIDE_TARGETS)
    assert job_config_from(wide.replace('flavor = "debug"', 'flavor = "135M"')).lora.rank == 544
    with pytest.raises(ValueError, match=r"rank = 544 is above the model's dimensions: the adapted linear w1 is "
                                         r"64 -> \d+; use a rank of at most 64"):
        job_config_from(wide)


def test_a_grpo_batch_that_dp_ranks_cannot_share_is_refused(monkeypatch) -> None:
    grpo = "[grpo]\nenabled = true\nrollouts = false\nprompts_per_step = 3\ngroup_size = 3\n"
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"3 \* 3 = 9 samples do not split over 2 data-parallel ranks"):
        job_config_from(DEBUG_LORA + grpo)
    # With 2-way TP on the 2 ranks the DP size is 1: any batch splits.
    tp2 = "[parallelism]\ntensor_parallel_degree = 2\ndisable_loss_parallel = true\n"
    assert job_config_from(DEBUG_LORA + grpo + tp2).grpo.group_size == 3
    monkeypatch.setenv("WORLD_SIZE", "4")  # 4 ranks, 2-way TP: DP 2 again
    with pytest.raises(ValueError, match="over 2 data-parallel ranks"):
        job_config_from(DEBUG_LORA + grpo + tp2)


def test_torchtitans_misleading_index_warning_is_dropped_and_others_kept(caplog) -> None:
    import logging

    with caplog.at_level(logging.WARNING):
        job_config_from(DEBUG_LORA)  # installs the filter
        logging.getLogger().warning("model.safetensors.index.json not found at hf_assets_path: /x/y.json")
        logging.getLogger().warning("HF assets path /elsewhere does not exist!")  # another warning: kept
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "index.json" in m], messages
    assert "HF assets path /elsewhere does not exist!" in messages


def test_run_section_values_torchtitan_or_the_first_step_would_refuse_are_refused_when_read(monkeypatch) -> None:
    """Each of these was accepted and failed only after the model was built (or the engine started)."""
    cases = {
        ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "x"):
            '[activation_checkpoint] selective_ac_option = "x": write a positive integer N',
        ("--compile.enable", "--compile.backend", "nonexistent"):
            "[compile] backend = 'nonexistent' is not a torch.compile backend here",
        ("--lr_scheduler.total_steps", "0"): "[lr_scheduler] total_steps must be >= 1, got 0",
        ("--training.global_batch_size", "100000"): "a global batch of 100000 sequences",
    }
    for overrides, message in cases.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            job_config_from(DEBUG_LORA, *overrides)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"global_batch_size = 3 does not split over 2 data-parallel ranks"):
        job_config_from(DEBUG_LORA, "--training.global_batch_size", "3")
    # What they accept still loads: "op", a debug backend, an even batch.
    cfg = job_config_from(DEBUG_LORA, "--activation_checkpoint.mode", "selective",
                          "--activation_checkpoint.selective_ac_option", "op", "--compile.enable",
                          "--compile.backend", "eager", "--training.global_batch_size", "4")
    assert (cfg.activation_checkpoint.selective_ac_option, cfg.compile.backend) == ("op", "eager")


def test_a_tp_degree_that_does_not_divide_the_heads_is_refused_naming_a_fit() -> None:
    from titan_lora.model_shape import DecoderShape
    from titan_lora.trainer.preflight import check_tensor_parallel_heads

    shape = DecoderShape(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=8, ffn_hidden_dim=128,
                         vocab_size=100, norm_eps=1e-5, rope_theta=1e4)
    check_tensor_parallel_heads(2, shape)
    check_tensor_parallel_heads(1, dataclasses.replace(shape, n_kv_heads=1))
    with pytest.raises(ValueError) as err:
        check_tensor_parallel_heads(4, shape)
    assert str(err.value) == ("[parallelism] tensor_parallel_degree = 4 must divide the model's 8 attention heads "
                              "and 2 KV heads (torchtitan shards attention by whole heads); choose a TP degree "
                              "that divides 2")
