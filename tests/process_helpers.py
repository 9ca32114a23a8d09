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


ENGINE_MODULE = "titan_lora.engines.vllm_openai"


def listening_port(proc) -> int | None:
    """The TCP port `proc` listens on, if any."""
    import psutil

    try:
        ports = [c.laddr.port for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
    except psutil.Error:
        return None
    return ports[0] if ports else None


def engine_servers(job_pid: int, module: str = ENGINE_MODULE) -> dict[int, int]:
    """port -> pid of each live engine API server under a job's process tree: a process of `module` (started
    as `python -m module`, or a standby interpreter running it: `python -m titan_lora.engines.standby module`)
    that listens (a standby still waiting for its start does not)."""
    import psutil

    out = {}
    for proc in psutil.Process(job_pid).children(recursive=True):
        try:
            if module in " ".join(proc.cmdline()) and proc.status() != psutil.STATUS_ZOMBIE:
                port = listening_port(proc)
                if port is not None:
                    out[port] = proc.pid
        except psutil.NoSuchProcess:
            continue
    return out


def engine_pid(job_pid: int) -> int | None:
    """The live vLLM API server process (the engine) under a job's process tree, if any."""
    return next(iter(engine_servers(job_pid).values()), None)
