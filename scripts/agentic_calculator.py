"""The agentic example: calculator episodes over the OpenAI chat API against a titan_lora vLLM engine.

    python scripts/agentic_calculator.py [--url URL --model policy] [--n 20 --digits 2 --seed 0]

Each episode (`titan_lora.rl.agentic`) asks a seeded arithmetic question under `--model` (the bare
adapter name is the newest synced version), runs the model's `CALC: <expr>` call if it makes one, and
finishes on the version that answered the first turn; it prints every episode (turns, tool call,
result, reward, served version) and the accuracy. With `--url` it attaches to a running engine (the
key from TITAN_LORA_API_KEY), e.g. the one a training job keeps synced; without it, it starts an engine
on the SmolLM2 checkpoint and uses the base model, which serves no adapter.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_lora.clients.kinds import LaunchRequest, engine_kind
from titan_lora.clients.launch import EmbeddedEngine, free_port
from titan_lora.clients.openai_rollout import OpenAIRolloutClient
from titan_lora.config import Engine
from titan_lora.models.smollm2 import pretrained_dir
from titan_lora.rl.agentic import run_episode
from titan_lora.rl.tasks import ArithTask
from titan_lora.transfer.protocol import API_KEY_ENV


def main() -> None:
    """Run `--n` episodes and print them, then the accuracy and how often the tool was called."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="", help="a running engine; empty: start one on SmolLM2")
    ap.add_argument("--model", default="", help="adapter alias or versioned name; empty: the base model")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--digits", type=int, default=2, help="operand digits of the questions")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    engine = None
    if not args.url:
        plan = engine_kind("vllm").launch(LaunchRequest(Engine(max_model_len=512, kv_cache_gib=1), 2,
                                                        str(pretrained_dir()), torch.device("cpu"), 16))
        engine = EmbeddedEngine(plan, free_port(),
                                os.path.join(tempfile.gettempdir(), "titan_lora_agentic_engine.log"))
        engine.start()
    try:
        url, key = (engine.url, engine.key) if engine else (args.url, os.environ.get(API_KEY_ENV, ""))
        chat = OpenAIRolloutClient(url, key, timeout_s=300)
        model = args.model or chat.client.models.list().data[0].id
        rewards, calls = [], 0
        for k, problem in enumerate(ArithTask(args.digits, "+-").problems(args.n, args.seed)):
            seed = None if args.temperature == 0 else args.seed + 2 * k
            ep = run_episode(chat, model, problem, max_tokens=args.max_tokens, temperature=args.temperature,
                             seed=seed)
            rewards.append(ep.reward)
            calls += ep.tool_call is not None
            print(f"{problem.question} (answer {problem.answer}) on {ep.model} (version {ep.version}): "
                  f"{ep.replies} tool {ep.tool_call!r} -> {ep.tool_result!r} reward {ep.reward:g}")
        print(f"accuracy {sum(rewards) / len(rewards):.2f} over {len(rewards)} episodes; "
              f"tool called in {calls / len(rewards):.2f}")
    finally:
        if engine is not None:
            engine.stop()


if __name__ == "__main__":
    main()
