"""Engine processes that vLLM spawns end with their parent.

vLLM's engine-core process does not watch the API server that spawned it: a SIGKILLed server (a crash,
a chaos test, the launcher killing a hung engine) would leave the engine core running, holding the
model, its KV cache and the trainer's mapped buffers, one more per restart. Where the kernel can
tie a child's life to its parent's (Linux: PR_SET_PDEATHSIG), every `multiprocessing` child of
`engines.vllm_openai` (spawned children import the parent's main module) gets SIGKILL when its parent
goes. A process started any other way is left as it is.
"""

from __future__ import annotations

import multiprocessing

from titan_lora.transfer.parent_death import die_with_parent


def die_with_spawning_parent() -> bool:
    """In a `multiprocessing` child on Linux: be killed when the parent exits; True when armed.

    Called while a spawned child imports its parent's main module, before `multiprocessing` records
    the parent: the child is known by its name (the parent's is MainProcess), the parent by getppid().
    """
    return multiprocessing.current_process().name != "MainProcess" and die_with_parent()
