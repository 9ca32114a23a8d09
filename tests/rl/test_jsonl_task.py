"""The JSONL task (`[grpo] task = "jsonl"`): its files checked line by line, the held-out split by
fraction or by file, the chat template with `system`, and the `[task]` section checked when read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_helpers import DEBUG_LORA, job_config_from

from titan_lora.compose import check_plugins, configured_task
from titan_lora.config import GRPO
from titan_lora.rl.jsonl import JsonlTask, jsonl_task, read_jsonl
from titan_lora.rl.objective import GRPOObjective
from titan_lora.rl.sample_source import sample_source
from titan_lora.rl.rewards import get_reward
from titan_lora.rl.task import Problem, Task, build_task, task_prompt, train_and_heldout
from titan_lora.titan.parallel import DataParallelInfo


def write_jsonl(path: Path, rows: list) -> Path:
    """One JSON value per line (strings are written as they are, to make bad lines)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def qa(n: int, start: int = 0, **extra: object) -> list[dict]:
    return [{"prompt": f"What is {i} + 1?", "answer": str(i + 1), **extra} for i in range(start, start + n)]


@pytest.mark.parametrize(("line", "fragments"), [
    ('{"prompt": "a", "answer": ', ["not valid JSON", "column", '{"prompt": "What is 2 + 2?", "answer": "4"}']),
    ('["a", "b"]', ["a JSON list, not an object"]),
    ('{"prompt": "a", "solution": "b"}', ['no "answer" (keys: prompt, solution)']),
    ('{"question": "a", "answer": "b"}', ['no "prompt" (keys: answer, question)']),
    ('{"prompt": "  ", "answer": "b"}', ['"prompt" must be a non-empty string']),
    ('{"prompt": "a", "answer": null}', ['"answer" must be a string or a number, got None']),
    ('{"prompt": "a", "answer": true}', ['"answer" must be a string or a number, got True']),
    ('{"prompt": "a", "answer": "b", "system": 3}', ['"system" must be a string when given, got 3']),
])
def test_a_bad_line_is_named_by_file_and_line(tmp_path: Path, line: str, fragments: list[str]) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [*qa(2), "", line])  # the blank line 3 is skipped, counted
    with pytest.raises(ValueError) as err:
        read_jsonl(str(path), "[task] path")
    assert str(err.value).startswith(f"{path}:4: ")
    for fragment in fragments:
        assert fragment in str(err.value)


@pytest.mark.parametrize(("extract", "answer", "message"), [
    ("last_number", '"sNaN"', "the answer 'sNaN' is not a finite number (NaN and Infinity equal no "
                              "completion's number); write the answer as a finite number such as \"4\""),
    ("boxed", '"NaN"', "the answer 'NaN' is not a finite number"),
    ("boxed", '"-Infinity"', "the answer '-Infinity' is not a finite number"),
    ("exact", "NaN", '"answer" is nan, not a finite number; write a finite number such as 4'),  # JSON's NaN
    ("exact", "1e400", '"answer" is inf, not a finite number'),
    ("last_number", '"Paris"', "the answer 'Paris' is not a number, and [task] extract = 'last_number'"),
])
def test_an_answer_no_completion_can_match_is_refused_by_file_and_line(tmp_path: Path, extract: str,
                                                                        answer: str, message: str) -> None:
    bad = '{"prompt": "What is 0/0?", "answer": ' + answer + "}"
    path = write_jsonl(tmp_path / "d.jsonl", [*qa(12), bad])
    with pytest.raises(ValueError) as err:
        jsonl_task(GRPO(), path=str(path), extract=extract)
    assert str(err.value).startswith(f"{path}:13: {message}")


def test_text_answers_stay_valid_where_the_mode_compares_text(tmp_path: Path) -> None:
    rows = [*qa(12), {"prompt": "Half?", "answer": r"\frac{1}{2}"}, {"prompt": "0/0?", "answer": "NaN"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    assert len(read_jsonl(str(path), "[task] path", "exact")) == 14
    boxed = read_jsonl(str(write_jsonl(tmp_path / "b.jsonl", rows[:-1])), "x", "boxed")
    assert boxed[-1].answer == r"\frac{1}{2}"


def test_a_byte_that_is_not_utf8_is_named_by_file_line_and_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": "1"}\n\n{"prompt": "Caf\xe9?", "answer": "2"}\n')
    with pytest.raises(ValueError) as err:  # was a bare UnicodeDecodeError, with no file or line
        read_jsonl(str(path), "[task] path")
    assert str(err.value) == (f"{path}:3: byte 16 of the line (0xe9) is not UTF-8; save the file as UTF-8 "
                              "(e.g. `iconv -f latin1 -t utf-8 in.jsonl > out.jsonl`)")
    path.write_bytes('\ufeff{"prompt": "Café?", "answer": "2"}\r\n'.encode())  # a byte-order mark, CRLF
    assert read_jsonl(str(path), "[task] path") == [Problem("Café?", "2")]


def test_records_keep_their_system_and_numbers_become_strings(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "answer": 7, "system": "s", "id": 1},
                                              {"prompt": "q", "answer": 2.5}])
    assert read_jsonl(str(path), "[task] path") == [Problem("p", "7", "s"), Problem("q", "2.5")]


def test_a_missing_or_empty_file_names_the_key_and_the_format(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^\[task\] path = '.*nope.jsonl' is not a file \(relative paths start"):
        read_jsonl(str(tmp_path / "nope.jsonl"), "[task] path")
    with pytest.raises(ValueError, match=r"^\[task\] heldout_path = '.*e.jsonl' has no records; each line"):
        read_jsonl(str(write_jsonl(tmp_path / "e.jsonl", ["", " "])), "[task] heldout_path")


def _questions(problems: list[Problem]) -> set[str]:
    return {p.question for p in problems}


def test_heldout_by_fraction_is_disjoint_and_the_same_for_every_seed(tmp_path: Path) -> None:
    rows = qa(40) + qa(5)  # 5 prompts twice: both copies fall on the same side
    task = jsonl_task(GRPO(), path=str(write_jsonl(tmp_path / "d.jsonl", rows)), heldout_fraction=0.25)
    assert len(task.heldout) + len(task.train) == 45 and len(_questions(list(task.heldout))) == 10
    assert not _questions(list(task.train)) & _questions(list(task.heldout))
    assert task == jsonl_task(GRPO(seed=9), path=str(tmp_path / "d.jsonl"), heldout_fraction=0.25)
    train, held = train_and_heldout(task, n_train=20, n_heldout=4, seed=3)
    assert len(train) == 20 and held == list(task.heldout[:4]) and not _questions(train) & _questions(held)
    assert (train, held) == train_and_heldout(task, 20, 4, seed=3) and train != train_and_heldout(task, 20, 4, 4)[0]
    default = jsonl_task(GRPO(), path=str(tmp_path / "d.jsonl"))  # 10% without a held-out file
    assert len(_questions(list(default.heldout))) == 4


def test_heldout_by_file_is_that_file_and_never_trained_on(tmp_path: Path) -> None:
    train_file = write_jsonl(tmp_path / "train.jsonl", qa(30))
    held_file = write_jsonl(tmp_path / "held.jsonl", qa(10, start=25))  # 5 prompts also in train
    task = jsonl_task(GRPO(), path=str(train_file), heldout_path=str(held_file))
    assert list(task.heldout) == read_jsonl(str(held_file), "x")
    assert _questions(list(task.train)) == _questions(read_jsonl(str(train_file), "x")[:25])
    train, held = train_and_heldout(task, n_train=100, n_heldout=100, seed=0)
    assert len(train) == 25 and len(held) == 10 and not _questions(train) & _questions(held)


@pytest.mark.parametrize(("options", "message"), [
    ({"heldout_path": "h.jsonl", "heldout_fraction": 0.2}, "[task] sets both heldout_path and heldout_fraction"),
    ({"heldout_fraction": 1.0}, "[task] heldout_fraction = 1.0: use a fraction in (0, 1)"),
    ({"heldout_fraction": 0.0}, "[task] heldout_fraction = 0.0: use a fraction in (0, 1)"),
    ({"heldout_fraction": 0.9}, "leaves 1 training records outside the held-out set, fewer than [grpo] "
                                "prompts_per_step = 8; add records, lower prompts_per_step or hold out less"),
    ({"extract": "boxd"}, "[task] extract = 'boxd' is not an extraction mode"),
])
def test_bad_task_options_are_refused(tmp_path: Path, options: dict, message: str) -> None:
    write_jsonl(tmp_path / "h.jsonl", qa(2))
    path = write_jsonl(tmp_path / "d.jsonl", qa(10))
    options = {k: str(tmp_path / v) if k == "heldout_path" else v for k, v in options.items()}
    with pytest.raises(ValueError) as err:
        jsonl_task(GRPO(), path=str(path), **options)
    assert message in str(err.value)


def test_the_reward_uses_the_extraction_mode() -> None:
    p = Problem("What is 1 + 1?", "2")
    assert JsonlTask((p,), (), "boxed").reward(r"so \boxed{2}", p) == 1.0
    assert JsonlTask((p,), (), "boxed").reward("so 2", p) == 0.0
    assert JsonlTask((p,), (), "last_number").reward("so 2", p) == 1.0
    assert JsonlTask((p,), (), "exact").reward("2", p) == 1.0 and JsonlTask((p,), (), "exact").reward("2.", p) == 0.0
    # `[grpo] reward = "exact_match"` over a JSONL task: its answers are strings.
    assert get_reward("exact_match")("so 2.", p) == 1.0 and get_reward("exact_match")("so 3", p) == 0.0


def test_the_prompt_is_rendered_through_the_chat_template_with_the_system(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    task = JsonlTask((), (), instruction=r"Put the answer in \boxed{}.")
    assert task_prompt(tok, task, "What is 2 + 2?", "You are terse.") == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2? Put the answer in \\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
    # No system in the record: the template's own default system turn.
    assert task_prompt(tok, JsonlTask((), ()), "Hi").startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


class CharTokenizer:
    """Characters as token ids; a visible chat template."""

    eos_token, eos_token_id, pad_token_id = "</s>", 0, 0

    def apply_chat_template(self, messages, tokenize: bool, add_generation_prompt: bool) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [ord(c) for c in text]}


def test_the_objective_encodes_each_records_system(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", qa(20, system="Be brief."))
    cfg = GRPO(enabled=True, task="jsonl", rollouts=False, eval_size=3, train_size=10)
    task = build_task(cfg, {"path": str(path), "instruction": "Answer with a number."})
    obj = GRPOObjective(cfg, task, CharTokenizer(), None, DataParallelInfo(0, 1, None), torch.device("cpu"), None,
                        sample_source(cfg))
    assert len(obj.train_problems) == 10 and obj.heldout == list(task.heldout)
    assert ["".join(map(chr, ids)) for ids in obj.heldout_ids] == [
        f"<system>Be brief.<user>{p.question} Answer with a number.<assistant>" for p in task.heldout]


# ---- [task] as read from TOML, checked before anything is built -------------------------------------------

GRPO_JSONL = '[grpo]\nenabled = true\nrollouts = false\ntask = "jsonl"\n'


def _job(task: str, grpo: str = GRPO_JSONL, *overrides: str):
    return job_config_from(DEBUG_LORA + grpo + "[task]\n" + task, *overrides)


def test_the_task_section_is_read_and_passed_to_the_task(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", qa(20))
    cfg = _job(f'path = "{path}"\nextract = "exact"\nheldout_fraction = 0.5\n')
    assert cfg.task == {"path": str(path), "extract": "exact", "heldout_fraction": 0.5}
    check_plugins(cfg)
    task = configured_task(cfg)
    assert isinstance(task, JsonlTask) and task.extract == "exact" and len(task.heldout) == 10
    other = write_jsonl(tmp_path / "o.jsonl", qa(12, start=100))  # the CLI overrides a [task] key
    assert configured_task(_job(f'path = "{path}"\n', GRPO_JSONL, f"--task.path={other}")).train[0].question \
        in {p.question for p in read_jsonl(str(other), "x")}


@pytest.mark.parametrize(("task", "grpo", "message"), [
    ('pth = "x.jsonl"\n', GRPO_JSONL, "[task] has an unknown key 'pth' for [grpo] task = 'jsonl'; did you mean 'path'?"),
    ('extract = "boxed"\n', GRPO_JSONL, "[task] path is required by [grpo] task = 'jsonl'; add `path = ...`"),
    ("path = 3\n", GRPO_JSONL, "[task] path = 3 must be of type str for [grpo] task = 'jsonl'"),
    ('path = "{d}"\nheldout_fraction = "a tenth"\n', GRPO_JSONL, "[task] heldout_fraction = 'a tenth' must be"),
    ('path = "{d}"\nextract = "box"\n', GRPO_JSONL, "[task] extract = 'box' is not an extraction mode"),
    ('path = "{d}/none.jsonl"\n', GRPO_JSONL, "[task] path = '{d}/none.jsonl' is not a file"),
    ('path = "{d}/bad.jsonl"\n', GRPO_JSONL, "{d}/bad.jsonl:2: not valid JSON"),
    ("digits = 2\n", "[grpo]\nenabled = true\nrollouts = false\n",
     "[task] digits is set, but [grpo] task = 'arith' takes no [task] keys; remove the [task] section"),
    ("stepz = 3\n", '[grpo]\nenabled = true\nrollouts = false\ntask = "word_problems"\n',
     "[task] has an unknown key 'stepz' for [grpo] task = 'word_problems'; did you mean 'steps'?"),
])
def test_a_bad_task_section_fails_before_the_model_is_built(tmp_path: Path, task: str, grpo: str,
                                                            message: str) -> None:
    write_jsonl(tmp_path / "bad.jsonl", [*qa(1), "{oops"])
    cfg = _job(task.replace("{d}", str(tmp_path)), grpo)
    with pytest.raises(ValueError) as err:
        check_plugins(cfg)
    assert message.replace("{d}", str(tmp_path)) in str(err.value)


def _fake_sync(monkeypatch: pytest.MonkeyPatch) -> list[list[list[int]]]:
    """The syncer, base stream and tokenizer faked in `compose`: the batches the parity probe is given."""
    import transformers

    from titan_lora import compose

    probed: list[list[list[int]]] = []

    class Syncer:
        def __init__(self, *args, versions, engine, probe, report, watchdog, base_digests) -> None:
            self.versions, self.with_engine, self.families = versions, None, [versions]

        def check_engine(self) -> None:
            pass

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path: CharTokenizer())
    monkeypatch.setattr(compose, "ParityProbe", lambda model, seqs, *args: probed.append(seqs))
    monkeypatch.setattr(compose, "WeightSyncer", Syncer)
    monkeypatch.setattr(compose, "base_weights_source", lambda *args: None)
    return probed


PROBED_JSONL = '[engine]\nkind = "receiver"\n[weight_sync]\nenabled = true\nparity_every = 1\n'


def test_the_parity_probe_scores_the_configured_tasks_prompts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from titan_lora import compose

    path = write_jsonl(tmp_path / "d.jsonl", qa(20, system="Be brief."))
    cfg = job_config_from(DEBUG_LORA + GRPO_JSONL + f'[task]\npath = "{path}"\n' + PROBED_JSONL)
    (tmp_path / "config.json").write_text("{}")
    probed = _fake_sync(monkeypatch)
    built = types.SimpleNamespace(hf_dir=str(tmp_path), model=None, sd_adapter=None, tied=True, peft_layout=None)
    compose.build_sync(cfg, None, built, torch.device("cpu"), compose.EngineSide(), check_plugins(cfg))
    texts = ["".join(map(chr, s)) for s in probed[0]]
    task = configured_task(cfg)
    assert texts == [f"<system>Be brief.<user>{p.question}<assistant>{p.answer}</s>"
                     for p in task.problems(4, compose.PROBE_SEED)]
    assert {t.split("<user>")[1].split("<")[0] for t in texts} <= {p.question for p in task.train}


def test_the_file_is_read_once_for_the_objective_and_the_probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from titan_lora import compose, train
    from titan_lora.rl import jsonl

    path = write_jsonl(tmp_path / "d.jsonl", qa(20))
    (tmp_path / "job.toml").write_text(DEBUG_LORA + GRPO_JSONL + f'[task]\npath = "{path}"\n' + PROBED_JSONL)
    (tmp_path / "config.json").write_text("{}")
    reads: list[str] = []
    read = jsonl.read_jsonl
    monkeypatch.setattr(jsonl, "read_jsonl", lambda path, *args: (reads.append(path), read(path, *args))[1])
    runs = []

    class Run:
        def __init__(self, job_config, task: Task | None, model: object = None) -> None:
            runs.append((job_config, task))

        def train(self) -> None:
            pass

        def close(self) -> None:
            pass

    monkeypatch.setattr(train, "TrainingRun", Run)
    monkeypatch.setattr(train.signal, "signal", lambda *args: None)
    train.main(["--job.config_file", str(tmp_path / "job.toml")])
    [(cfg, task)] = runs
    assert isinstance(task, JsonlTask) and reads == [str(path)], "checked before the run, and handed to it"
    probed = _fake_sync(monkeypatch)
    monkeypatch.setattr(compose, "GRPOObjective", lambda grpo, task, *args: task)
    built = types.SimpleNamespace(hf_dir=str(tmp_path), model=None, sd_adapter=None, tied=True, peft_layout=None)
    compose.build_sync(cfg, None, built, torch.device("cpu"), compose.EngineSide(), task)
    dims = types.SimpleNamespace(get_optional_mesh=lambda name: None)
    assert compose.build_objective(cfg, str(tmp_path), dims, torch.device("cpu"), None, None, task) is task
    assert reads == [str(path)], "the objective and the probe use the task check_plugins built"
    assert ["".join(map(chr, s)) for s in probed[0]] == [
        f"<user>{p.question}<assistant>{p.answer}</s>" for p in task.problems(4, compose.PROBE_SEED)]
