"""Mutation testing of titan_lora's core with mutmut 3.x against the FAST test suite; kill rate per module.

Not run in CI (it is slow). It works on a scratch copy of the repository, so the checkout is never
modified, and bounds the whole mutmut run with a timeout. Usage, from the repository root:

    pip install "mutmut>=3.8,<4"
    python scripts/mutation.py                                     # the core modules below
    python scripts/mutation.py titan_lora/rl/grpo.py --timeout-s 1200
    python scripts/mutation.py titan_lora/lora/layer.py --equivalent 'titan_lora.lora.layer.x_f__mutmut_3'

Kill rate = killed / (all mutants - those named with --equivalent). "no tests" mutants are in code that
no fast test reaches in the pytest process itself (code that runs only in spawned ranks counts there).
docs/testing.md records the figures, the survivors and the judgement of each.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = [
    "titan_lora/sync/*.py", "titan_lora/clients/*.py", "titan_lora/transfer/*.py", "titan_lora/clients/http.py",
    "titan_lora/rl/grpo.py", "titan_lora/rl/objective.py", "titan_lora/export/peft.py",
    "titan_lora/lora/layer.py",
]
FAST = "not slow and not gpu and not sglang"
_MODULE = re.compile(r"^(?P<module>.+?)\.x[_ǁ]")


def setup_cfg(modules: list[str], tests: list[str]) -> str:
    """mutmut's [mutmut] section (setup.cfg: pyproject.toml has no [tool.mutmut], so mutmut reads this)."""
    def lines(values: list[str]) -> str:
        return "".join(f"\n    {v}" for v in values)

    return (
        "[mutmut]\nsource_paths = titan_lora\n"
        f"only_mutate ={lines(modules)}\n"
        f"pytest_add_cli_args ={lines(['-m', FAST, '-p', 'no:cacheprovider', '-q'])}\n"
        f"pytest_add_cli_args_test_selection ={lines(tests)}\n"
        "process_isolation = forkserver\n"  # torch is not fork-safe once it has run threads
    )


def scratch_copy(workdir: Path) -> None:
    """The sources, tests and pyproject.toml in `workdir` (mutmut writes its mutants/ there)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("titan_lora", "tests"):
        shutil.copytree(ROOT / name, workdir / name, ignore=ignore, dirs_exist_ok=True)
    shutil.copy(ROOT / "pyproject.toml", workdir / "pyproject.toml")


def run_mutmut(workdir: Path, max_children: int, timeout_s: float) -> int:
    """`mutmut run` in `workdir`, bounded by `timeout_s`; its return code (124 on timeout)."""
    mutmut = shutil.which("mutmut", path=str(Path(sys.executable).parent)) or "mutmut"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # mutmut puts mutants/ first itself
    env["OMP_NUM_THREADS"] = "1"
    try:
        return subprocess.run([mutmut, "run", "--max-children", str(max_children)], cwd=workdir, env=env,
                              timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:
        print(f"mutmut run stopped after {timeout_s:.0f} s; the figures below cover the mutants it finished")
        return 124


def results(workdir: Path) -> dict[str, str]:
    """mutant name -> status, from `mutmut results --all true`."""
    mutmut = shutil.which("mutmut", path=str(Path(sys.executable).parent)) or "mutmut"
    out = subprocess.run([mutmut, "results", "--all", "true"], cwd=workdir, capture_output=True, text=True,
                         check=True).stdout
    pairs = (line.strip().rsplit(": ", 1) for line in out.splitlines() if ": " in line)
    return {name: status for name, status in pairs}


def report(statuses: dict[str, str], equivalent: set[str]) -> list[str]:
    """Print one line per module (counts by status, kill rate) and return the surviving mutants."""
    by_module: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for name, status in statuses.items():
        module = m.group("module") if (m := _MODULE.match(name)) else "?"
        by_module[module]["equivalent" if name in equivalent else status] += 1
    print(f"{'module':34} {'mutants':>7} {'killed':>6} {'survived':>8} {'no tests':>8} {'timeout':>7} "
          f"{'equiv.':>6} {'kill rate':>9}")
    for module, counts in sorted(by_module.items()):
        total = sum(counts.values())
        judged = total - counts["equivalent"] - counts["not checked"]
        rate = counts["killed"] / judged if judged else float("nan")
        print(f"{module:34} {total:7} {counts['killed']:6} {counts['survived']:8} {counts['no tests']:8} "
              f"{counts['timeout']:7} {counts['equivalent']:6} {rate:9.1%}")
    return sorted(n for n, s in statuses.items() if s in ("survived", "no tests") and n not in equivalent)


def main() -> None:
    """Parse arguments, run mutmut on a scratch copy, print the figures and the survivors."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modules", nargs="*", default=CORE, help="files or globs under titan_lora/ to mutate")
    parser.add_argument("--tests", nargs="+", default=["tests/"], help="test paths mutmut may select from")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="bound on the whole mutmut run")
    parser.add_argument("--max-children", type=int, default=1, help="parallel mutant workers")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch directory (kept); default: temp")
    parser.add_argument("--equivalent", nargs="*", default=[], help="mutant names judged equivalent")
    parser.add_argument("--show", action="store_true", help="print the diff of every survivor")
    args = parser.parse_args()

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="titan_lora_mutation_"))
    workdir.mkdir(parents=True, exist_ok=True)
    scratch_copy(workdir)
    (workdir / "setup.cfg").write_text(setup_cfg(args.modules, args.tests))
    print(f"mutmut in {workdir} on {' '.join(args.modules)}, fast suite: -m '{FAST}'", flush=True)
    code = run_mutmut(workdir, args.max_children, args.timeout_s)
    survivors = report(results(workdir), set(args.equivalent))
    print(f"\nmutmut exit code {code}; {len(survivors)} survivor(s):")
    mutmut = shutil.which("mutmut", path=str(Path(sys.executable).parent)) or "mutmut"
    for name in survivors:
        print(f"  {name}")
        if args.show:
            subprocess.run([mutmut, "show", name], cwd=workdir, check=False)


if __name__ == "__main__":
    main()
