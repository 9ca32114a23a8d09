"""The code keeps the project's ruff rules (pyproject.toml's [tool.ruff.lint]), and every `# noqa` marker
names a rule it really silences (RUF100): a marker that silences nothing is an error, not decoration."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUFF = Path(sys.executable).parent / "ruff"


@pytest.mark.skipif(not RUFF.exists(), reason="ruff is a dev tool: GPU hosts running `pytest -m gpu` may lack it")
def test_ruff_passes_with_the_projects_rules() -> None:
    done = subprocess.run([str(RUFF), "check", "--no-cache", "--output-format", "concise", "titan_lora", "scripts",
                           "tests"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
