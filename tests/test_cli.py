"""`titan-lora check` and `titan-lora train`: a newcomer's sixteen common mistakes each give one line naming
the key and the fix (exit code 2, nothing started); the shipped configs pass; a failure after the start
ends with the failing rank's own error line; docs/config.md is what the generator writes."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from model_helpers import DEBUG_LORA

from titan_lora import cli

REPO = Path(__file__).resolve().parents[1]
SFT_DATA = REPO / "titan_lora" / "data" / "arith_sft.jsonl"
BASE = DEBUG_LORA + f'[data]\npath = "{SFT_DATA}"\n'
SYNC = '[weight_sync]\nenabled = true\n'
GRPO_NO_ROLLOUTS = "[grpo]\nenabled = true\nrollouts = false\nprompts_per_step = 2\ngroup_size = 2\n"

MISTAKES = {
    # Clear before this work (kept so).
    "rank zero": (BASE.replace("rank = 8", "rank = 0"), "[lora] rank must be a positive integer, got 0; try rank = 16"),
    "a misspelt key": (BASE.replace("rank = 8", "rnak = 8"), "[lora] has an unknown key 'rnak'; did you mean 'rank'?"),
    "unknown engine kind": (BASE + SYNC + '[engine]\nkind = "vlm"\n', "[engine] kind = 'vlm'"),
    "unknown transport": (BASE + SYNC + '[engine]\ntransport = "rdma"\n', "[engine] transport = 'rdma'"),
    "unknown standby mode": (BASE + SYNC + '[engine]\nstandby = "yes"\n', "[engine] standby = 'yes': use auto, on, off"),
    "missing checkpoint": (
        BASE.replace('name = "smollm2"\nflavor = "debug"\nload_pretrained = false',
                     'name = "qwen3"\nload_pretrained = true\nhf_assets_path = "/nonexistent/Qwen3-0.6B"'),
        "[model] load_pretrained = true needs an HF checkpoint, but /nonexistent/Qwen3-0.6B has no config.json",
    ),
    "a JSONL task without a path": (BASE + GRPO_NO_ROLLOUTS + 'task = "jsonl"\n', "[task] path"),
    "target modules that match nothing": (
        BASE.replace('"all-linear"', '["wq", "qproj"]'), "[lora] target_modules",
    ),
    "keep_versions too small": (BASE + SYNC + "keep_versions = 1\n", "[weight_sync] keep_versions must be >= 2, got 1"),
    "unknown converter": (BASE.replace('converters = ["lora"]', 'converters = ["lroa"]'), "[model] converters names 'lroa'"),
    "dropout": (BASE.replace("[lora]\n", "[lora]\ndropout = 1.0\n"), "[lora] dropout must be in [0, 1), got 1.0"),
    # A raw traceback, or the engine started first, before this work.
    "rank as a word": (BASE.replace("rank = 8", 'rank = "sixteen"'),
                       '[lora] rank = "sixteen" must be an integer (the default is rank = 16)'),
    "lr as a word": (BASE + '[optimizer]\nlr = "fast"\n', '[optimizer] lr = "fast" must be a number'),
    "negative steps": (BASE.replace("[training]\n", "[training]\nsteps = -1\n"),
                       "[training] steps must be >= 1, got -1; the number of optimizer steps: try steps = 20"),
    "negative temperature": (BASE + GRPO_NO_ROLLOUTS + "temperature = -1.0\n",
                             "[grpo] temperature must be > 0, got -1.0; try temperature = 1.0"),
    # Accepted, then a traceback or a silent misbehaviour after the start (NaN passed every lower bound).
    "an endless transfer timeout": (BASE + SYNC + "timeout_s = inf\n",
                                    "[weight_sync] timeout_s must be a finite number > 0 and <= 86400 seconds"),
    "a NaN KL weight": (BASE + GRPO_NO_ROLLOUTS + "kl_coef = nan\n",
                        "[grpo] kl_coef must be a finite number >= 0, got nan; 0 skips the KL term"),
    "an operator arith does not compute": (BASE + GRPO_NO_ROLLOUTS + 'task_ops = "+%"\n',
                                           "[grpo] task_ops = '+%': '%' is not an operator arith computes"),
    "an engine url that is no address": (BASE + SYNC + '[engine]\nurl = "not a url"\n',
                                         "[engine] url: 'not a url' is not an engine address"),
    "a seq_len shorter than the prompts": (
        BASE.replace("seq_len = 64", "seq_len = 4") + GRPO_NO_ROLLOUTS,
        "[training] seq_len = 4 cannot hold the task's longest prompt (44 tokens) plus [grpo] max_new_tokens = 8"),
    "a max_model_len shorter than the prompts": (
        BASE + SYNC + "[engine]\nmax_model_len = 40\n" + GRPO_NO_ROLLOUTS.replace("rollouts = false\n", ""),
        "[engine] max_model_len = 40 cannot hold the task's longest prompt (44 tokens) plus [grpo] max_new_tokens"),
    "more prompts per step than problems": (BASE + GRPO_NO_ROLLOUTS + "train_size = 1\n",
                                            "[grpo] prompts_per_step = 2 is more than train_size = 1"),
    # Partly clear before this work.
    "unknown section": (BASE + SYNC.replace("weight_sync", "weightsync"),
                        "[weightsync] is not a config section; did you mean 'weight_sync'?"),
    "TOML syntax error": (BASE.replace("rank = 8", "rank = 8 8"), ":8:10: TOML syntax error: "),
}


@pytest.mark.parametrize("command", ["check", "train"])
@pytest.mark.parametrize("case", list(MISTAKES))
def test_each_mistake_is_one_line_naming_the_key(case: str, command: str, tmp_path, capsys, monkeypatch) -> None:
    toml, expected = MISTAKES[case]
    config = tmp_path / "job.toml"
    config.write_text(toml)
    monkeypatch.chdir(tmp_path)  # nothing is written: the dump folder (./outputs) must not appear
    launched = []
    monkeypatch.setattr(cli, "launch", lambda *a: launched.append(a) or 0)
    argv = ["check", str(config)] if command == "check" else ["train", str(config), "--nproc", "2"]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert len(lines) == 1, f"{case}: {err}"
    assert expected in lines[0], f"{case}: {expected!r} missing from {lines[0]!r}"
    prefix = f"{config}: config error: " if command == "check" else "titan_lora: config error: "
    assert lines[0].startswith(prefix), lines[0]
    assert not out and not launched and not (tmp_path / "outputs").exists()


def test_a_config_path_that_is_a_directory_is_one_line(tmp_path, capsys) -> None:
    assert cli.main(["check", str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"{tmp_path}: config error: --job.config_file {str(tmp_path)!r} cannot be read (Is a directory); "
        "name a TOML file"]


def test_several_mistakes_are_one_line_each_and_cli_overrides_are_checked(tmp_path, capsys) -> None:
    config = tmp_path / "job.toml"
    config.write_text(BASE.replace("rank = 8", 'rank = "sixteen"') + '[optimizer]\nlr = "fast"\n')
    assert cli.main(["check", str(config), "--lora.rnak", "3", "--grpo.temperature", "hot"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(": config error: ")[1] for line in lines] == [
        '[lora] rank = "sixteen" must be an integer (the default is rank = 16)',
        '[optimizer] lr = "fast" must be a number (the default is lr = 0.0008)',
        "--lora.rnak: [lora] has an unknown key 'rnak'; did you mean 'rank'?",
        "--grpo.temperature 'hot': [grpo] temperature must be a number",
    ]
    config.write_text(BASE)
    assert cli.main(["check", str(config), "--training.steps", "0", "--parallelism.disable_loss_parallel"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"{config}: config error: [training] steps must be >= 1, got 0; the number of optimizer steps: try steps = 20"]


def test_every_shipped_config_passes_the_check(capsys, tmp_path) -> None:
    configs = sorted(str(p.relative_to(REPO)) for p in (REPO / "train_configs").rglob("*.toml"))
    assert len(configs) >= 6 and any("gpu/" in c for c in configs)
    cwd = os.getcwd()
    os.chdir(REPO)  # the configs name their data relative to the repository
    try:
        # An empty run folder: the checkout's own outputs/ (a finished run of a config) would be refused.
        rc = cli.main(["check", *configs, "--nproc", "2", "--job.dump_folder", str(tmp_path)])
    finally:
        os.chdir(cwd)
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.splitlines() == [f"{c}: ok" for c in configs]


def test_every_shipped_grpo_config_with_rollouts_also_passes_in_the_async_loop(capsys, tmp_path) -> None:
    """The configs say `--grpo.loop async` runs them: nothing they set (e.g. keep_versions) may refuse it. Those
    with several `[[adapters]]` take the sync loop only so far (their header says so)."""
    configs = sorted(str(p.relative_to(REPO)) for p in (REPO / "train_configs").rglob("*.toml")
                     if (grpo := (toml := tomllib.loads(p.read_text())).get("grpo", {})).get("enabled")
                     and grpo.get("rollouts", True) and len(toml.get("adapters", [])) <= 1)
    assert "train_configs/smollm2_grpo_calculator.toml" in configs and len(configs) >= 3
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        rc = cli.main(["check", *configs, "--nproc", "2", "--grpo.loop", "async",
                       "--job.dump_folder", str(tmp_path)])
    finally:
        os.chdir(cwd)
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    assert out.splitlines() == [f"{c}: ok" for c in configs]


def test_the_console_script_is_declared() -> None:
    """`pip install -e .` installs `titan-lora` from here; the module itself runs as
    `python -m titan_lora.cli` in test_a_failure_after_the_start_ends_with_the_root_cause."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"titan-lora": "titan_lora.cli:main"}
    assert callable(cli.main)


def _torchrun_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    return {**env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def test_plain_torchrun_prints_a_config_error_once_before_building(tmp_path) -> None:
    config = tmp_path / "job.toml"
    config.write_text(MISTAKES["negative temperature"][0] + f'[job]\ndump_folder = "{tmp_path}/run"\n')
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                           "titan_lora.train", "--job.config_file", str(config)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=_torchrun_env())
    assert proc.returncode != 0
    line = "titan_lora: config error: [grpo] temperature must be > 0, got -1.0; try temperature = 1.0"
    out = proc.stdout + proc.stderr
    assert out.count(line) == 1, out[-3000:]  # rank 0 only, through its error file
    root_cause = out[out.index("Root Cause (first observed failure):"):]
    assert "  rank      : 0 (local_rank: 0)" in root_cause and f"  traceback : {line}" in root_cause, out
    # What is left is torchrun's own: 3 log lines, its 16-line traceback and 20-line block; no rank's.
    assert out.count("Traceback (most recent call last)") == 1 and len(out.splitlines()) <= 45, out
    assert not (tmp_path / "run").exists(), "nothing is built or written"
    print(f"torchrun, 2 ranks, config error: {time.monotonic() - started:.1f} s")


def test_a_config_error_the_ranks_find_ends_the_launch_with_it(tmp_path, capsys, monkeypatch) -> None:
    # `launch` without `train`'s check first: the error comes from rank 0, through torchrun's error file (rank 1
    # waits for rank 0 to fail first: CI once saw rank 1 named, with no message, and no root cause shown).
    config = tmp_path / "job.toml"
    config.write_text(MISTAKES["rank zero"][0] + f'[job]\ndump_folder = "{tmp_path}/run"\n')
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(REPO)
    assert cli.launch(str(config), [], 2) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == ("titan-lora: training failed (exit code 1); root cause, rank 0: titan_lora: config "
                       "error: [lora] rank must be a positive integer, got 0; try rank = 16"), err[-5:]
    assert not (tmp_path / "run").exists()


def test_a_failure_after_the_start_ends_with_the_root_cause(tmp_path) -> None:
    # A valid config whose first optimizer step overflows float32: caught after the start, by the ranks.
    config = tmp_path / "job.toml"
    config.write_text(BASE.replace("[training]\n", "[training]\nsteps = 2\nlocal_batch_size = 2\n")
                      + f'[optimizer]\nlr = 1e300\n[job]\ndump_folder = "{tmp_path}/run"\n')
    proc = subprocess.run([sys.executable, "-m", "titan_lora.cli", "train", str(config), "--nproc", "2"], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=_torchrun_env())
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("titan-lora: training failed (exit code 1); root cause, rank "), last
    assert "NonFiniteAdapterError: step 1: adapter tensor" in last and "holds NaN/Inf" in last, last
    shown = proc.stdout.splitlines()  # rank 0's lines bare, the other ranks' labelled
    assert any(line.startswith("[titan_lora ") and "rank 0/2 on cpu" in line for line in shown), shown[:20]
    assert not any(line.startswith("[default0]:") for line in shown), shown[:20]
    assert any(line.startswith("[default1]:") for line in shown), shown[-40:]


def test_root_cause_prefers_torchruns_named_rank_and_our_own_error_line() -> None:
    lines = ["[default1]:[rank1]: Traceback (most recent call last):", "[default1]:[rank1]: RuntimeError: peer gone",
             "[default0]:titan_lora: config error: [lora] rank must be a positive integer, got 0",
             "[default0]:[rank0]: SystemExit: 2", "Root Cause (first observed failure):",
             "[0]:", "  rank      : 0 (local_rank: 0)"]
    assert cli.root_cause(lines) == (0, "titan_lora: config error: [lora] rank must be a positive integer, got 0")
    assert cli.root_cause(lines[:2]) == (1, "RuntimeError: peer gone")
    assert cli.root_cause(["no rank output"]) is None
    cause = "titan_lora: config error: [lora] rank must be a positive integer, got 0"
    block = ["[default1]:[rank1]: SystemExit: 143", "Root Cause (first observed failure):", "[1]:",
             "  rank      : 0 (local_rank: 0)", f"  traceback : {cause}"]
    assert cli.root_cause(block) == (0, cause), "rank 0 printed nothing: its error file, in the block"
    # torchrun named rank 1, which left no message; rank 0's error file is in the block's other failures.
    named_other = ["[default0]:loading the config", "Failures:", "[0]:", "  rank      : 0 (local_rank: 0)",
                   f"  traceback : {cause}", "Root Cause (first observed failure):", "[1]:",
                   "  rank      : 1 (local_rank: 1)", "  traceback : To enable traceback see: https://x"]
    assert cli.root_cause(named_other) == (0, cause)


def test_the_ranks_but_0_wait_on_a_config_error_so_that_rank_0_fails_first(monkeypatch) -> None:
    from titan_lora import train

    slept: list[float] = []
    monkeypatch.setattr(train.time, "sleep", slept.append)
    monkeypatch.setenv("WORLD_SIZE", "2")
    train.let_rank0_fail_first()
    monkeypatch.setenv("WORLD_SIZE", "1")
    train.let_rank0_fail_first()
    assert slept == [train.RANK0_FIRST_S], "bounded, and only with other ranks to wait for"


def test_docs_config_md_is_what_the_generator_writes() -> None:
    spec = importlib.util.spec_from_file_location("gen_config_doc", REPO / "scripts" / "gen_config_doc.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    text = gen.render()
    for row in ("| `rank` | an integer | `16` | a positive integer |", "| `temperature` | a number | `1.0` | > 0 |",
                "| `steps` | an integer |", "## [lr_scheduler]"):
        assert row in text, row
    assert (REPO / "docs" / "config.md").read_text() == text, "run: python scripts/gen_config_doc.py"


# A stand-in torchrun: says where it is, then waits; a SIGTERM is written down (torchrun stops its ranks on it).
_TORCHRUN_STANDIN = """
import os, signal, sys, time
mark = sys.argv[1]
def stop(sig, _frame):
    open(mark, "a").write(f"{signal.Signals(sig).name}\\n")
    sys.exit(128 + sig)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGHUP, stop)
print(f"standin {os.getpid()}", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP", "SIGKILL"])
def test_torchrun_ends_with_the_launcher_however_it_is_stopped(sig: str, tmp_path) -> None:
    # Signalled alone (not its process group), the launcher once left torchrun running with its ranks and engine.
    import psutil
    import signal

    mark = tmp_path / "signals"
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import sys; from titan_lora.cli import supervise; "
         "rc, _, by = supervise(sys.argv[1:]); print(f'stopped by {by}', file=sys.stderr); sys.exit(rc)",
         sys.executable, "-c", _TORCHRUN_STANDIN, str(mark)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        standin = psutil.Process(int(launcher.stdout.readline().split()[1]))
        launcher.send_signal(getattr(signal, sig))
        launcher.wait(timeout=10)
        psutil.wait_procs([standin], timeout=5)
        assert not standin.is_running() or standin.status() == psutil.STATUS_ZOMBIE
        assert mark.read_text() == ("SIGTERM\n" if sig == "SIGKILL" else f"{sig}\n")
        if sig != "SIGKILL":
            assert launcher.returncode == 128 + getattr(signal, sig)  # torchrun's exit code, passed on
            assert launcher.stderr.read().strip() == f"stopped by {int(getattr(signal, sig))}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
