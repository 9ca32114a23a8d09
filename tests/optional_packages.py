"""The packages some test modules need that a GPU host lacks, and those modules (tests/conftest.py leaves them
out where a package is missing; tests/test_environment.py requires every one on CPU)."""

NEEDS: dict[str, list[str]] = {
    "vllm": ["engines/test_vllm_*.py"],
    "tinker": ["service/test_*.py"],
    "uvicorn": ["service/test_*.py"],
    "starlette": ["service/test_*.py", "engines/test_episode_capture.py"],
    "openai": ["rl/test_agent_episodes.py"],
}
"""Each optional package -> the test modules that import it (directly or through the code they test)."""
