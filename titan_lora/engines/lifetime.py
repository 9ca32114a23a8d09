"""Engine processes that vLLM starts (spawned, or forked on CPU) end with their parent.

vLLM's engine-core process does not watch the API server that spawned it: a SIGKILLed server (a crash,
a chaos test, the launcher killing a hung engine) would leave the engine core running, holding the
model, its KV cache and the trainer's mapped buffers, one more per restart. Where the kernel can
tie a child's life to its parent's (Linux: PR_SET_PDEATHSIG), every `multiprocessing` child of
`engines.vllm_openai` gets SIGKILL when its parent goes: a spawned child arms it while it imports the
parent's main module, a forked one right after the fork. A process started any other way is left as it is.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import socket

from titan_lora.transfer.parent_death import die_with_parent


def die_with_spawning_parent() -> bool:
    """In a `multiprocessing` child on Linux: be killed when the parent exits; True when armed.

    Called while a spawned child imports its parent's main module, before `multiprocessing` records
    the parent: the child is known by its name (the parent's is MainProcess), the parent by getppid().
    """
    return multiprocessing.current_process().name != "MainProcess" and die_with_parent()


def children_die_with_this_process() -> bool:
    """Arm both paths from the engine's main module: the children this process forks from now on die with
    it (armed at each fork), and, in a spawned child importing it, this process with its parent (True)."""
    os.register_at_fork(after_in_child=die_with_parent)
    return die_with_spawning_parent()


def forked_children_close_port(port: int) -> None:
    """The children this process forks from now on close their copy of its server socket on `port`: vLLM binds
    it before it forks the engine core and listens on it after, so a core would share the listening socket
    and keep the port taken after the API server died, until the core itself had exited (a restarted engine
    could not bind it meanwhile)."""
    os.register_at_fork(after_in_child=functools.partial(close_bound, port))


def close_bound(port: int) -> None:
    """Close this process's TCP socket(s) bound to local `port` (its copies only: the parent keeps them)."""
    for name in os.listdir("/proc/self/fd"):
        try:
            copy = os.dup(int(name))
        except OSError:  # the directory's own descriptor, closed by now
            continue
        try:
            sock = socket.socket(fileno=copy)
        except OSError:  # not a socket: the copy is ours to close
            os.close(copy)
            continue
        with sock:
            try:
                bound = sock.getsockname()
            except OSError:
                continue
            if sock.type == socket.SOCK_STREAM and isinstance(bound, tuple) and bound[1] == port:
                os.close(int(name))
