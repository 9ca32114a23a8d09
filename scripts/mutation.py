"""Mutation testing of titan_lora's core with mutmut 3.x against the FAST test suite; kill rate per module.

Not run in CI (it is slow). It works on a scratch copy of the repository, so the checkout is never
modified, and bounds the whole mutmut run with a timeout. Usage, from the repository root:

    pip install "mutmut>=3.8,<4"
    python scripts/mutation.py                                     # the core modules below
    python scripts/mutation.py titan_lora/rl/grpo.py --timeout-s 1200
    python scripts/mutation.py titan_lora/lora/layer.py --equivalent 'titan_lora.lora.layer.x_f__mutmut_3'
    python scripts/mutation.py titan_lora/sync/syncer.py --workdir /tmp/mut --rerun-unkilled   # after new tests
    python scripts/mutation.py titan_lora/rl/objective.py --tests tests/rl/a.py tests/rl/new.py \
        --workdir /tmp/mut --rerun-unkilled --widen-tests          # a test file added to the selection
    python scripts/mutation.py titan_lora/sync/base_stream.py --tests tests/sync/test_base_stream.py \
        --rerun 'titan_lora.sync.base_stream.x_base_weights_source__mutmut_24'   # one mutant, other tests

Kill rate = (killed + timed out) / (mutants checked - those named with --equivalent). "no tests" mutants are
in code that no fast test reaches. mutmut itself records which tests reach a function only in the pytest process;
this script adds the functions reached in processes the tests start (spawned ranks, engine processes):
while mutmut collects its statistics, a `sitecustomize` in those processes writes each function they
enter to a file, and a pytest plugin credits it to the test that was running (see `HITS_PLUGIN`).
docs/testing.md records the figures, the survivors and the judgement of each.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = [
    "titan_lora/sync/*.py", "titan_lora/clients/*.py", "titan_lora/transfer/*.py", "titan_lora/compose.py",
    "titan_lora/rl/grpo.py", "titan_lora/rl/objective.py", "titan_lora/export/peft.py",
    "titan_lora/lora/layer.py",
]
FAST = "not slow and not gpu and not sglang"
_MODULE = re.compile(r"^(?P<module>.+?)\.x[_ǁ]")
HITS_ENV = "TITAN_LORA_MUTATION_HITS"

# Loaded in the tests' processes (`-p _mutation_hits_plugin`). While mutmut collects statistics (the
# mutant under test is "stats"), child processes get HITS_ENV (a directory) and the `sitecustomize`
# below on PYTHONPATH; before each test's teardown, the names they wrote are added to mutmut's record
# of that test's hits, ahead of mutmut's own teardown hook, which maps them to the test.
HITS_PLUGIN = '''
import os, shutil, tempfile
from pathlib import Path

import pytest

_dir = None


def pytest_configure(config):
    global _dir
    from mutmut.mutation.trampoline import get_mutant_under_test
    if get_mutant_under_test() != "stats":
        return
    _dir = tempfile.mkdtemp(prefix="titan_lora_hits_")
    os.environ["HITS_ENV"] = _dir
    site = str(Path(__file__).parent / "_mutation_site")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    if _dir is None:
        return
    from mutmut.state import state
    for f in Path(_dir).glob("*.hits"):
        taken = f.with_suffix(".taken")
        try:
            f.rename(taken)  # a process that writes again starts a new file
            names = taken.read_text(encoding="utf-8").split()
            taken.unlink()
        except OSError:
            continue
        state()._stats.update(names)


def pytest_unconfigure(config):
    if _dir is not None:
        shutil.rmtree(_dir, ignore_errors=True)
'''.replace("HITS_ENV", HITS_ENV)

# sitecustomize for the tests' child processes while statistics are collected: every function the
# mutmut trampoline records is appended (once per process) to a file of this process in HITS_ENV.
HITS_SITE = '''
import os

if os.environ.get("HITS_ENV") and os.environ.get("MUTANT_UNDER_TEST") == "stats":
    import mutmut.stats

    _seen = set()
    _path = os.path.join(os.environ["HITS_ENV"], f"{os.getpid()}.hits")

    def _record(name, caller=None):
        if name not in _seen:
            _seen.add(name)
            try:
                with open(_path, "a", encoding="utf-8") as f:
                    f.write(name + "\\n")
            except OSError:
                pass

    mutmut.stats.record_trampoline_hit = _record  # before the trampoline module binds it
'''.replace("HITS_ENV", HITS_ENV)


def setup_cfg(modules: list[str], tests: list[str]) -> str:
    """mutmut's [mutmut] section (setup.cfg: pyproject.toml has no [tool.mutmut], so mutmut reads this)."""
    def lines(values: list[str]) -> str:
        return "".join(f"\n    {v}" for v in values)

    return (
        "[mutmut]\nsource_paths = titan_lora\n"
        f"only_mutate ={lines(modules)}\n"
        f"pytest_add_cli_args ={lines(['-m', FAST, '-p', 'no:cacheprovider', '-p', '_mutation_hits_plugin', '-q'])}\n"
        f"pytest_add_cli_args_test_selection ={lines(tests)}\n"
        f"also_copy ={lines(['_mutation_hits_plugin.py', '_mutation_site'])}\n"
        "process_isolation = forkserver\n"  # torch is not fork-safe once it has run threads
    )


def scratch_copy(workdir: Path) -> None:
    """The sources, tests and pyproject.toml in `workdir` (mutmut writes its mutants/ there)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("titan_lora", "tests"):
        shutil.copytree(ROOT / name, workdir / name, ignore=ignore, dirs_exist_ok=True)
    shutil.copy(ROOT / "pyproject.toml", workdir / "pyproject.toml")
    (workdir / "_mutation_hits_plugin.py").write_text(HITS_PLUGIN)
    (workdir / "_mutation_site").mkdir(exist_ok=True)
    (workdir / "_mutation_site" / "sitecustomize.py").write_text(HITS_SITE)


def run_mutmut(workdir: Path, max_children: int, timeout_s: float, names: list[str] | None = None) -> int:
    """`mutmut run` in `workdir` (only the mutants in `names`, when given), bounded by `timeout_s`; its
    return code (124 on timeout)."""
    mutmut = shutil.which("mutmut", path=str(Path(sys.executable).parent)) or "mutmut"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # mutmut puts mutants/ first itself
    env["OMP_NUM_THREADS"] = "1"
    # Its own process group: on timeout, or when this script is stopped, its workers and the processes their
    # tests started go with it (a mutmut left running would go on writing results into `workdir`).
    proc = subprocess.Popen([mutmut, "run", "--max-children", str(max_children), *(names or [])], cwd=workdir,
                            env=env, start_new_session=True)

    def stop() -> None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop()
        print(f"mutmut run stopped after {timeout_s:.0f} s; the figures below cover the mutants it finished")
        return 124
    except BaseException:  # SIGTERM (via sys.exit) or Ctrl-C
        stop()
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def widen_selection(workdir: Path, tests: list[str]) -> None:
    """Record `tests` as the test selection of the earlier run in `workdir`, so that mutmut keeps its verdicts
    and only collects statistics for the tests that are new. Refused unless every earlier entry is still
    selected. The fingerprint is computed as mutmut 3.8 does (sha256 of the repr of the tuple, 12 hex digits)."""
    import configparser
    import hashlib
    import json

    cfg = configparser.ConfigParser()
    cfg.read(workdir / "setup.cfg")
    before = cfg["mutmut"]["pytest_add_cli_args_test_selection"].split()
    uncovered = [t for t in before if not any(t == n or t.startswith(n.rstrip("/") + "/") for n in tests)]
    if uncovered:
        raise SystemExit(f"--widen-tests: the earlier selection had {uncovered}, which --tests leaves out")
    stats_path = workdir / "mutants" / "mutmut-stats.json"
    stats = json.loads(stats_path.read_text())
    stats["config_fingerprint"]["test_selection"] = hashlib.sha256(repr(tuple(tests)).encode()).hexdigest()[:12]
    stats_path.write_text(json.dumps(stats, indent=4))


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
          f"{'equiv.':>6} {'unchecked':>9} {'kill rate':>9}")
    for module, counts in sorted(by_module.items()):
        total = sum(counts.values())
        judged = total - counts["equivalent"] - counts["not checked"]
        # A mutant that makes a test hang is caught (the suite would not pass): timeouts count as killed.
        rate = (counts["killed"] + counts["timeout"]) / judged if judged else float("nan")
        print(f"{module:34} {total:7} {counts['killed']:6} {counts['survived']:8} {counts['no tests']:8} "
              f"{counts['timeout']:7} {counts['equivalent']:6} {counts['not checked']:9} {rate:9.1%}")
    return sorted(n for n, s in statuses.items()
                  if s in ("survived", "no tests", "suspicious") and n not in equivalent)


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
    parser.add_argument("--equivalent-file", type=Path, default=None,
                        help="a file of mutant names judged equivalent, one a line ('#' starts a comment)")
    parser.add_argument("--rerun-unkilled", action="store_true",
                        help="in an existing --workdir: run again every mutant not killed (after adding tests)")
    parser.add_argument("--rerun", nargs="+", default=None, metavar="NAME",
                        help="run only these mutants (mutmut names; '*' globs allowed), e.g. again after adding tests")
    parser.add_argument("--widen-tests", action="store_true",
                        help="with --rerun-unkilled: the new --tests only add to the earlier run's; keep its verdicts "
                             "(more tests cannot turn a killed mutant into a survivor) instead of starting over")
    parser.add_argument("--show", action="store_true", help="print the diff of every survivor")
    args = parser.parse_args()
    if args.equivalent_file:
        lines = (line.split("#", 1)[0].strip() for line in args.equivalent_file.read_text().splitlines())
        args.equivalent += [line for line in lines if line]

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="titan_lora_mutation_"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.widen_tests:
        widen_selection(workdir, args.tests)
    scratch_copy(workdir)
    (workdir / "setup.cfg").write_text(setup_cfg(args.modules, args.tests))
    print(f"mutmut in {workdir} on {' '.join(args.modules)}, fast suite: -m '{FAST}'", flush=True)
    names = args.rerun
    if args.rerun_unkilled:
        if not (workdir / "mutants").is_dir():
            parser.error("--rerun-unkilled needs the --workdir of an earlier run")
        names = sorted(n for n, s in results(workdir).items() if s not in ("killed", "timeout"))
        print(f"running again the {len(names)} mutants not killed", flush=True)
    code = run_mutmut(workdir, args.max_children, args.timeout_s, names) if names != [] else 0
    survivors = report(results(workdir), set(args.equivalent))
    print(f"\nmutmut exit code {code}; {len(survivors)} survivor(s):")
    mutmut = shutil.which("mutmut", path=str(Path(sys.executable).parent)) or "mutmut"
    for name in survivors:
        print(f"  {name}")
        if args.show:
            subprocess.run([mutmut, "show", name], cwd=workdir, check=False)


if __name__ == "__main__":
    main()
