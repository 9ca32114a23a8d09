"""The package layering holds: import-linter's contracts in .importlinter (layers, the engine process
importing only the transfer layer, no cycles, the vLLM and torchtitan fences) are all kept."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp")  # a dev tool: GPU hosts running `pytest -m gpu` may lack it

REPO = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept() -> None:
    lint = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run([str(lint), "--no-cache", "--no-logo"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout
    assert "ignored import" not in done.stdout, "a contract is kept only by an exception: " + done.stdout[-2000:]


def test_only_the_seam_imports_torchtitan() -> None:
    graph = grimp.build_graph("titan_lora", include_external_packages=True)
    seam = {"titan_lora.titan", *graph.find_descendants("titan_lora.titan")}
    outside = graph.find_modules_that_directly_import("torchtitan") - seam
    assert not outside, f"torchtitan imported outside titan_lora/titan/: {sorted(outside)}"
    fenced = {d["line_contents"] for d in graph.get_import_details(
        importer="titan_lora.titan.configs", imported="torchtitan")}
    assert "from torchtitan.config import TORCH_DTYPE_MAP, CompileConfig, ParallelismConfig" in fenced, (
        "the seam moved: update this test")
