"""The CPU suite's environment: what must be installed for every module to be collected."""

from __future__ import annotations

import importlib.util

import pytest
from optional_packages import NEEDS


@pytest.mark.parametrize("package", sorted(NEEDS))
def test_every_optional_package_is_installed_so_its_tests_run(package: str) -> None:
    """Without one the modules that need it are left out (tests/conftest.py): fail here rather than pass
    without them. GPU hosts (`pytest -m gpu`, without vLLM or the service's packages) deselect this test."""
    assert importlib.util.find_spec(package) is not None, (
        f"{package} is not importable, so tests/{', tests/'.join(NEEDS[package])} were left out: run the "
        "README's setup (bash scripts/setup.sh)")
