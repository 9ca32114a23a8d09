"""`titan-lora`, the command for people: `check` a config without starting anything, `train`: check it
once, then run `torchrun -m titan_lora.train` with the same arguments, or `serve` the Tinker API over it.

    titan-lora check train_configs/smollm2_grpo_arith.toml [--section.key value ...]
    titan-lora train train_configs/smollm2_grpo_arith.toml --nproc 2 [--section.key value ...]
    titan-lora serve train_configs/smollm2_service.toml [--service.port 8000 ...]

A config error is one line per mistake and exit code 2, before torchrun starts (no model, no engine, no
process group); a failure after the start ends with the failing rank's own error line.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterable

from titan_lora.transfer.parent_death import die_with_parent

CONFIG_ERROR_EXIT = 2


def config_errors(path: str, overrides: list[str], nproc: int = 1) -> list[str]:
    """The config errors of `path` with `overrides` for a run of `nproc` ranks, one line each (empty: the
    job would start). Runs every check training runs before building (the TOML, the values, the model's
    checkpoint and targets, the engine settings, the task and its data); builds and starts nothing."""
    from titan_lora.compose import check_plugins
    from titan_lora.rl.prompt_lengths import check_prompt_lengths
    from titan_lora.trainer.job_config import load_job

    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(nproc)  # how the GRPO batch splits over data-parallel ranks
    try:
        job_config, model = load_job(["--job.config_file", path, *overrides])
        check_prompt_lengths(job_config, check_plugins(job_config), model.hf_dir)
    except (ValueError, FileNotFoundError) as err:
        return str(err).splitlines() or [repr(err)]
    finally:
        if saved is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = saved
    return []


def check(configs: list[str], overrides: list[str], nproc: int) -> int:
    """`titan-lora check`: every config's errors as `CONFIG: config error: ...` lines; 2 if any."""
    failed = 0
    for path in configs:
        errors = config_errors(path, overrides, nproc)
        for line in errors:
            print(f"{path}: config error: {line}", file=sys.stderr)
        if not errors:
            print(f"{path}: ok")
        failed += bool(errors)
    return CONFIG_ERROR_EXIT if failed else 0


# torchrun --tee prefixes `[<role><local_rank>]:`; torch's own excepthook may add `[rank<N>]: ` after it.
_RANK_PREFIX = re.compile(r"^\[(?P<role>[\w-]+?)(?P<rank>\d+)\]:(\[rank\d+\]: ?)?(?P<line>.*)$")
_ROOT_CAUSE_RANK = re.compile(r"^\s*rank\s*:\s*(?P<rank>\d+)\s*\(local_rank:\s*(?P<local>\d+)\)")
_ERROR_LINE = re.compile(r"^(titan_lora: .*error: |[\w.]*(Error|Exception|Exit|Interrupt)\b(: |$))")
# What a rank wrote to its torchelastic error file (titan_lora.train's config errors), shown by the block.
_ROOT_CAUSE_MESSAGE = re.compile(r"^\s*traceback\s*:\s*(?P<line>titan_lora: .*error: .*)$")


def root_cause(lines: Iterable[str]) -> tuple[int, str] | None:
    """From torchrun's output with `--tee 3` (each rank's line prefixed `[default<local_rank>]:`): the
    local rank torchrun names as the root cause (else the first rank that printed an error) and that rank's
    own error line (its last exception or `titan_lora: ... error:` line, printed or, for a config error, in
    torchrun's failure block: the named rank's, else another rank's there); None when no rank left one."""
    errors: dict[int, str] = {}
    first: list[int] = []
    cause = None
    in_block, in_root_cause, block_rank = False, False, None
    messages: dict[int, str] = {}  # local rank -> its error file's message, from torchrun's failure block
    for raw in lines:
        m = _RANK_PREFIX.match(raw)
        if m:
            line = m["line"].strip()
            if _ERROR_LINE.match(line):
                rank = int(m["rank"])
                if rank not in first:
                    first.append(rank)
                # our own one-line error beats a traceback's last line; else the latest exception line
                if line.startswith("titan_lora: ") or not errors.get(rank, "").startswith("titan_lora: "):
                    errors[rank] = line
            continue
        in_block = in_block or "Failures:" in raw or "Root Cause" in raw
        in_root_cause = in_root_cause or "Root Cause" in raw
        rc = _ROOT_CAUSE_RANK.match(raw)
        if in_block and rc:
            block_rank = int(rc["local"])
            if in_root_cause and cause is None:
                cause = block_rank
        message = _ROOT_CAUSE_MESSAGE.match(raw)
        if in_block and message and block_rank is not None:
            messages.setdefault(block_rank, message["line"])
    if cause is not None and cause in errors:
        return cause, errors[cause]
    if cause is not None and cause in messages:
        return cause, messages[cause]
    if messages:  # the named rank left no message (stopped, or it failed first without one): another's
        rank = min(messages)
        return rank, messages[rank]
    return (first[0], errors[first[0]]) if first else None


def launch(config: str, overrides: list[str], nproc: int, module: str = "titan_lora.train") -> int:
    """Run `torchrun -m <module>` (training, or the service) on the checked config, its output passed through;
    on a failure, end with the root cause. Returns torchrun's exit code."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "--tee", "3",
           "-m", module, "--job.config_file", config, *overrides]
    rc, seen, stopped_by = supervise(cmd)
    if stopped_by is not None:
        print(f"titan-lora: stopped by {signal.Signals(stopped_by).name}, passed on to torchrun, which stopped its "
              f"ranks and their engine (exit code {rc})", file=sys.stderr)
    elif rc != 0:
        found = root_cause(seen)
        where = f"rank {found[0]}: {found[1]}" if found else "no rank printed an error line; see above"
        what = "training" if module == "titan_lora.train" else "the service"
        print(f"titan-lora: {what} failed (exit code {rc}); root cause, {where}", file=sys.stderr)
    return rc


def supervise(cmd: list[str]) -> tuple[int, list[str], int | None]:
    """Run torchrun's `cmd`, its output passed through; returns its exit code, its last lines and the signal
    this launcher was stopped by and passed on (None: torchrun ended by itself). torchrun ends with this
    launcher however the launcher ends: SIGTERM and SIGHUP are passed on (torchrun then stops its ranks, and
    each rank its engine), and a launcher killed outright sends torchrun SIGTERM by its parent-death signal."""
    launcher = os.getpid()
    seen: list[str] = []
    stopped_by: list[int] = []

    def pass_on(sig: int, _frame: object) -> None:
        stopped_by.append(sig)
        proc.send_signal(sig)

    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                          preexec_fn=lambda: die_with_parent(launcher, signal.SIGTERM)) as proc:
        previous = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGTERM, signal.SIGHUP)}
        try:
            for line in proc.stdout:
                # --tee labels each line with its rank (for root_cause); rank 0's (the progress) show bare
                sys.stdout.write(line.removeprefix("[default0]:"))
                seen.append(line.rstrip("\n"))
                del seen[:-5000]  # enough to hold a rank's traceback and torchrun's block, bounded
            rc = proc.wait()
        except KeyboardInterrupt:  # torchrun got the same SIGINT: let it stop its ranks
            rc = proc.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return rc, seen, stopped_by[0] if stopped_by else None


def train(config: str, overrides: list[str], nproc: int) -> int:
    """`titan-lora train`: check once (one line per error, exit 2), then launch."""
    errors = config_errors(config, overrides, nproc)
    for line in errors:
        print(f"titan_lora: config error: {line}", file=sys.stderr)
    if errors:
        return CONFIG_ERROR_EXIT
    return launch(config, overrides, nproc)


def serve(config: str, overrides: list[str], nproc: int) -> int:
    """`titan-lora serve`: check the config as training does, and the `[service]` keys, then launch the
    Tinker-compatible service."""
    from titan_lora.service.main import service_errors
    from titan_lora.trainer.job_config import load_job

    errors = config_errors(config, overrides, nproc)
    if not errors:
        errors = service_errors(load_job(["--job.config_file", config, *overrides])[0])
    for line in errors:
        print(f"titan_lora: config error: {line}", file=sys.stderr)
    if errors:
        return CONFIG_ERROR_EXIT
    return launch(config, overrides, nproc, module="titan_lora.service.main")


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """`argv` split into the command's own arguments and the `--section.key [value]` overrides (a value
    follows unless it is joined by `=` or the key is a flag: true or false)."""
    from titan_lora.trainer.job_config import is_flag

    rest, overrides = [], []
    i = 0
    while i < len(argv):
        name = argv[i].split("=", 1)[0]
        if not (name.startswith("--") and "." in name):
            rest.append(argv[i])
            i += 1
            continue
        takes_value = "=" not in argv[i] and not is_flag(name) and i + 1 < len(argv)
        overrides += argv[i:i + 1 + takes_value]
        i += 1 + takes_value
    return rest, overrides


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="titan-lora", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check_p = sub.add_parser("check", help="validate configs (and the checkpoint, task and engine settings "
                                           "they name) without starting anything",
                             epilog="Any other --section.key value is an override, as in training "
                                    "(python -m titan_lora.train --help lists every key).")
    check_p.add_argument("configs", nargs="+", metavar="CONFIG")
    check_p.add_argument("--nproc", type=int, default=1, help="ranks the job will run on (default 1)")
    train_p = sub.add_parser("train", help="validate a config, then train it under torchrun",
                             epilog="Any other --section.key value is an override passed to every rank.")
    train_p.add_argument("config", metavar="CONFIG")
    train_p.add_argument("--nproc", type=int, default=1, help="torchrun --nproc_per_node (default 1)")
    serve_p = sub.add_parser("serve", help="serve the Tinker API (the tinker SDK's training calls) over a "
                                           "config's model", epilog="Any other --section.key value is an override.")
    serve_p.add_argument("config", metavar="CONFIG")
    serve_p.add_argument("--nproc", type=int, default=1, help="trainer ranks: torchrun --nproc_per_node (default 1)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The `titan-lora` console script; returns (and exits with) the command's exit code."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    rest, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(rest)
    if args.command == "check":
        rc = check(args.configs, overrides, args.nproc)
    elif args.command == "serve":
        rc = serve(args.config, overrides, args.nproc)
    else:
        rc = train(args.config, overrides, args.nproc)
    if argv is None:
        sys.exit(rc)
    return rc


if __name__ == "__main__":
    main()
