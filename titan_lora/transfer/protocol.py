"""The `/titan/*` engine protocol, defined once: routes, and the dataclasses both sides agree on.

Every titan_lora engine process (the vLLM engine, the receiver) serves these routes with JSON bodies
(rollouts go over the engine's own OpenAI API);
the trainer-side clients post to them. Neither side spells a route as a string literal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

API_KEY_ENV = "TITAN_LORA_API_KEY"
"""The engine's API key reaches it through this environment variable, never its command line."""
NONCE_ENV = "TITAN_LORA_ENGINE_NONCE"
"""The launcher's nonce, echoed by INFO: proof that the engine on a port is the one we started."""
STANDBY_MODULE = "titan_lora.engines.standby"
"""A pre-imported engine interpreter (`python -m STANDBY_MODULE MODULE`): it imports MODULE, writes one byte
to the descriptor STANDBY_READY_FD_ENV names, then reads one JSON line `{"argv": [...], "env": {...}}` on
stdin and runs MODULE's `main()` as `python -m MODULE *argv` would."""
STANDBY_READY_FD_ENV = "TITAN_LORA_STANDBY_READY_FD"
SKIP_BASE_DIGESTS_FLAG = "--titan-skip-base-digests"
"""The vLLM engine's flag (its launcher passes it under `[weight_sync] base = "push"`, where nobody asks for
BASE_DIGESTS): it records no digest of the base it loads and answers BASE_DIGESTS with none."""

HTTP_MARGIN_S = 10.0
"""Added to a request's own deadline (which the engine enforces and answers) for the HTTP timeout, which
then only catches an engine that went silent."""

PREFIX = "/titan/"
INFO = "info"
"""Incarnation, nonce, base version, live adapters, limits; GET or POST. Answered from the front's memory:
it cannot tell a wedged engine core (see LIVE)."""
LIVE = "live"
"""A no-op through the part of the engine that does the work, answered within the body's `timeout_s` or
refused with 504: on vLLM a `collective_rpc` to every worker of every engine core, on the receiver the
lock its transfers hold. A wedged core (a stuck kernel or collective) fails it while INFO still answers.
On a CPU vLLM engine, a core that misses the bound while computing one long step answers live with
`busy_s` (`engines.core_activity`)."""
BUCKET = "bucket"
"""One bucket of a transfer (base or adapter), acked with count, bytes and checksum."""
BASE = "base"
"""Commit a streamed base transfer; with `complete_from_disk` the engine reads every tensor not sent from
its own checkpoint (the trainer sent only those whose digests differed)."""
UNLOAD = "unload"
"""Retire one adapter once its requests drained."""
ADAPTER_FROM_PATH = "adapter_from_path"
"""Load a PEFT directory with the engine's own loader (the disk emitter, `vllm-disk`)."""

BASE_DIGESTS = "base_digests"
"""The digest of every base tensor the engine loaded (its own checkpoint at start-up, or a base commit) and
their dtype (`transfer.digest`); no digests when it loaded none (`--load-format dummy`)."""
BASE_VERIFIED = "base_verified"
"""The trainer found the engine's own base equal to its own, digest for digest: record it as ours (the
base version INFO reports) without a transfer."""
VERIFY_ROUTES = (BASE_DIGESTS, BASE_VERIFIED)
"""What an engine that loads the base itself serves (vLLM), so the trainer verifies instead of pushing; the
receiver serves BASE_DIGESTS alone, with no digests (it loads no checkpoint: it gets the whole base)."""

EPISODE_HEADER = "X-Titan-Episode"
"""A chat completion with this header (an id, `episodes.check_episode_id`) is a turn of that episode: the
engine records its token ids and log-probs and runs it on the episode's version (`transfer.episodes`)."""
EPISODE = "episode"
"""The record of one episode, {episode_id} -> `EpisodeRecord.to_json()`; 404 when the engine holds none."""
DELETE_EPISODE = "delete_episode"
"""Drop one episode the trainer has fetched, {episode_id} -> {deleted: bool}."""
EPISODE_ROUTES = (EPISODE, DELETE_EPISODE)
"""What an engine that serves the OpenAI chat API itself serves (vLLM); INFO then reports `episodes`."""

TRANSFER_ROUTES = (INFO, LIVE, BUCKET, BASE, UNLOAD)
"""What every engine that takes buckets serves."""
FRAMED_ROUTES = (BUCKET, BASE, UNLOAD)
"""What a trainer sends as frames (`transfer.frames`) to an engine that offers them; INFO, whose reply
makes the offer and carries the nonce, always goes over HTTP."""


ADAPTER_SET_SEP = "/"
"""Several adapters in one transfer: each tensor is named `<k>/<its PEFT name>`, k the adapter's place in the
commit's `adapters` list (PEFT names hold no '/'). The commit riding on the last bucket is then
`{"adapters": [{"name", "version", "peft_config"}, ...]}`, and its ack `{"adapters": [{"name", "version",
"tensors", "bytes"}, ...], "apply_ms", incarnation fields}`: one stream, one commit, K versions installed."""


def adapter_slots(adapters: int, keep_versions: int) -> int:
    """Live adapter versions an engine must hold: each adapter's retention window, plus its version being loaded."""
    return adapters * (keep_versions + 1)


def adapter_set_name(k: int, tensor_name: str) -> str:
    """The name of adapter `k`'s tensor `tensor_name` in a transfer of several adapters."""
    return f"{k}{ADAPTER_SET_SEP}{tensor_name}"


def adapter_set_part(name: str, count: int) -> tuple[int, str]:
    """(k, PEFT name) of a tensor named by `adapter_set_name` in a transfer of `count` adapters."""
    k, sep, tensor_name = name.partition(ADAPTER_SET_SEP)
    if not sep or not k.isdigit() or int(k) >= count:
        raise ValueError(f"tensor {name!r} of a transfer of {count} adapters is not named "
                         f"'<adapter index below {count}>{ADAPTER_SET_SEP}<PEFT name>'")
    return int(k), tensor_name


def path(route: str) -> str:
    """The URL path of `route`."""
    return PREFIX + route


def incarnation_fields(incarnation: str, base_version: int | None) -> dict[str, Any]:
    """The fields INFO and every commit's ack carry for `incarnation_of` to read."""
    return {"incarnation": incarnation, "base_version": base_version}


def incarnation_of(reply: Mapping[str, Any]) -> str:
    """The engine incarnation an INFO reply or a commit's ack names: the engine's id, suffixed while it holds
    no base from us (a restarted engine, or one that lost its weights, names another)."""
    return reply["incarnation"] + ("" if reply["base_version"] is not None else ":no-base")


def route_of(url_path: str) -> str | None:
    """The route a request path names, or None when it is not a `/titan/` path."""
    return url_path[len(PREFIX):] if url_path.startswith(PREFIX) else None


@dataclasses.dataclass(frozen=True)
class EngineLimits:
    """What the engine was started with, read at start-up to validate our adapter against it."""

    max_lora_rank: int
    max_loras: int
    target_modules: frozenset[str] | None  # HF leaf names (q_proj, ...); None: any linear
    expert_lora: bool | None = None
    """Whether it serves adapters on routed experts; None: it does not say (it holds bytes, as the receiver)."""


@dataclasses.dataclass(frozen=True)
class Ack:
    """What the engine reports it installed; the syncer compares it with what was sent."""

    version: int
    num_tensors: int
    nbytes: int
    phases_ms: Mapping[str, float] = dataclasses.field(default_factory=dict)
    incarnation: str | None = None
    """The engine incarnation that installed it (`incarnation_of`); None when the emitter cannot tell."""
