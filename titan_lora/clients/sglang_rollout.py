"""Rollouts from an SGLang 0.5.23 server through its native `/generate`, under the leased adapter name.

Token ids go in and token ids with per-token log-probs come out, one batched request per call. What this
relies on, from the 0.5.23 wheel (`sglang/api/v1/api_types.py`, `managers/io_struct.py`,
`managers/tokenizer_manager.py`, `layers/sampler.py`, `sampling/sampling_batch_info.py`):
- `input_ids` as a list of lists is a batch, answered as a list in the same order; `sampling_params`
  may be one dict per prompt; `lora_path` is the adapter's served name (None: the base);
- `meta_info.output_token_logprobs` holds `[logprob, token_id, text]` per token of `output_ids`, which
  keeps a matched stop token (only `text` drops it);
- greedy tokens (temperature below 1e-6) get `log_softmax(logits)`, sampled ones
  `log(softmax(logits / T))`: the model's own log-prob only at T = 1, so at any other T the completions
  are scored again (a prefill with `max_new_tokens = 0`), which gives what the trainer computes and what
  vLLM returns;
- `sampling_seed` is honoured only by a server started with `--enable-deterministic-inference`;
- `logprob_start_len = 0` returns the prompt's log-probs, `None` for the first token.
"""

from __future__ import annotations

import logging

from titan_lora.clients.base import Endpoint
from titan_lora.clients.rollout import Completion
from titan_lora.clients.sglang_api import SGLangClient, SGLangError, SGLangTimeout
from titan_lora.clients.sglang_generate import GenerateOutput, GenerateReqInput
from titan_lora.config import WeightSync

logger = logging.getLogger(__name__)

_SAMPLING_EPS = 1e-6  # SGLang samples greedily below this temperature (sampling_params.py)
# What 0.5.23 answers for a name it does not serve: never loaded; loaded once and unloaded (it tries to
# reload it from its placeholder path "__tensor__", which fails); unregistered while the request waited.
_NOT_SERVED = ("has never been loaded", "Failed to implicitly load LoRA adapter", "are not loaded")


class SGLangRolloutClient:
    """RolloutClient for an SGLang 0.5.23 server; every request ends within `timeout_s`
    (`[weight_sync] rollout_timeout_s`: the client hangs up, and SGLang aborts a request whose client
    left)."""

    def __init__(self, client: SGLangClient, timeout_s: float = 600.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"[weight_sync] rollout_timeout_s must be positive, got {timeout_s}")
        self.client = client
        self.timeout_s = timeout_s
        self._seed_checked = False

    def interrupt(self, reason: str) -> None:
        """End the requests in flight now (the server was found wedged): each raises EngineHung."""
        self.client.interrupt(reason)

    def generate(self, prompts: list[list[int]], adapter: str | None, max_tokens: int,
                 temperature: float, seed: int | None, stop_token_ids: list[int]) -> list[Completion]:
        """Sample one completion per prompt; prompt i is seeded with `seed + i` (as the vLLM engine does)."""
        if not prompts:
            return []
        if seed is not None:
            self._check_seed()
        params = [{"max_new_tokens": max_tokens, "temperature": temperature,
                   "stop_token_ids": list(stop_token_ids),
                   **({} if seed is None else {"sampling_seed": seed + i})} for i in range(len(prompts))]
        outs = self._post(GenerateReqInput(input_ids=[list(p) for p in prompts], sampling_params=params,
                                           lora_path=adapter, return_logprob=True), adapter)
        for o in outs:
            if len(o.output_logprobs) != len(o.output_ids):
                raise SGLangError(f"SGLang at {self.client.url} returned {len(o.output_logprobs)} log-probs "
                                  f"for {len(o.output_ids)} tokens on adapter {adapter!r}")
        logprobs = [o.output_logprobs for o in outs]
        if _SAMPLING_EPS <= temperature != 1.0:
            scored = self.score([list(p) + o.output_ids for p, o in zip(prompts, outs)], adapter)
            logprobs = [s[len(p) - 1:] for s, p in zip(scored, prompts)]
        return [Completion(o.output_ids, o.text, lp) for o, lp in zip(outs, logprobs)]

    def score(self, sequences: list[list[int]], adapter: str | None) -> list[list[float]]:
        """log p(token t | tokens < t) for every token after the first, from one prefill per sequence."""
        if not sequences:
            return []
        req = GenerateReqInput(input_ids=[list(s) for s in sequences], sampling_params={"max_new_tokens": 0},
                               lora_path=adapter, return_logprob=True, logprob_start_len=0)
        outs = self._post(req, adapter)
        scores = []
        for seq, o in zip(sequences, outs):
            lps = o.input_logprobs[1:]
            if len(lps) != len(seq) - 1 or any(lp is None for lp in lps):
                raise SGLangError(f"SGLang at {self.client.url} returned {len(o.input_logprobs)} prompt "
                                  f"log-probs for a sequence of {len(seq)} tokens on adapter {adapter!r}")
            scores.append(lps)
        return scores  # type: ignore[return-value]

    def _post(self, req: GenerateReqInput, adapter: str | None) -> list[GenerateOutput]:
        n = len(req.input_ids or [])
        try:
            return self.client.generate_batch(req, timeout_s=self.timeout_s)
        except SGLangTimeout as err:
            raise SGLangTimeout(f"SGLang at {self.client.url} did not finish {n} requests on adapter "
                                f"{adapter!r} within [weight_sync] rollout_timeout_s = {self.timeout_s:g}s; "
                                "raise it if the server is just slow") from err
        except SGLangError as err:
            if adapter is not None and any(m in str(err) for m in _NOT_SERVED):
                raise SGLangError(f"SGLang at {self.client.url} does not serve adapter {adapter!r}: it was "
                                  "retired or never loaded there; rollouts must use the name "
                                  f"AdapterVersions.lease() hands out (SGLang said: {err})") from err
            raise

    def _check_seed(self) -> None:
        """Warn once when the server ignores `sampling_seed`."""
        if self._seed_checked:
            return
        self._seed_checked = True
        if not self.client.server_info().deterministic_inference:
            logger.warning("SGLang at %s runs without --enable-deterministic-inference, so it ignores "
                           "sampling_seed: seeded rollouts will not repeat", self.client.url)


def sglang_rollouts(endpoint: Endpoint, ws: WeightSync) -> SGLangRolloutClient:
    """The rollout client of the SGLang server at `endpoint` (its `--api-key`, never the admin key)."""
    client = SGLangClient(endpoint.url, api_key=endpoint.api_key.value, timeout_s=ws.timeout_s, retries=ws.retries)
    return SGLangRolloutClient(client, ws.rollout_timeout_s)

