"""torchtitan 0.3.0 needs torch >= 2.12: an older torch is refused by name, before torchtitan's own import fails."""

from __future__ import annotations

import subprocess
import sys


def test_a_torch_without_2_12s_fsdp_api_is_refused_with_the_fix() -> None:
    code = ("import torch.distributed.fsdp as f; del f.DataParallelMeshDims\n"
            "import titan_lora.titan")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "ImportError: torchtitan 0.3.0 needs torch >= 2.12" in done.stderr, done.stderr[-2000:]
    assert "pip install 'torch>=2.12'" in done.stderr
