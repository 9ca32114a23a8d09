"""The package layering holds: import-linter's contracts in .importlinter (layers, the engine process
importing only the transfer layer, no cycles) are all kept."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept() -> None:
    lint = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run([str(lint), "--no-cache", "--no-logo"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout
    assert "ignored import" not in done.stdout, "a contract is kept only by an exception: " + done.stdout[-2000:]
