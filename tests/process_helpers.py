"""Finding the processes of a vLLM engine, to fault one part of it (its engine core) and not the rest."""

from __future__ import annotations


def engine_core_pid(api_server_pid: int) -> int:
    """The pid of vLLM's engine-core process under its API server (vLLM titles it `VLLM::EngineCore`)."""
    import psutil

    for proc in psutil.Process(api_server_pid).children(recursive=True):
        try:
            if "EngineCore" in " ".join(proc.cmdline()) and proc.status() != psutil.STATUS_ZOMBIE:
                return proc.pid
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no live VLLM::EngineCore process under pid {api_server_pid}")


def engine_pid(job_pid: int) -> int | None:
    """The live vLLM API server process (the engine) under a job's process tree, if any."""
    import psutil

    for proc in psutil.Process(job_pid).children(recursive=True):
        try:
            if "titan_lora.engines.vllm_openai" in " ".join(proc.cmdline()) and proc.status() != "zombie":
                return proc.pid
        except psutil.NoSuchProcess:
            continue
    return None
