"""Agent runs' environments (issue 31): the spec section, the built-in calculator, and the user's tools or
environment class checked as TRL will use them, before anything trains."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from jobs.chat_templates import ChatTemplateError, response_template
from jobs.contract import DEMO_MODEL_ID, SpecError
from jobs.demo.preset import demo_spec
from jobs.environments.calculator import calculate
from jobs.environments.loading import EnvironmentCodeError, trainer_arguments

TOOLS = '''
def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def shout(text: str) -> str:
    """Say it louder.

    Args:
        text: what to say
    """
    return text.upper()
'''

ENVIRONMENT = '''
class Counter:
    def reset(self, **row):
        self.count = 0
        return "Count to three."

    def increment(self, by: int) -> int:
        """Add to the count.

        Args:
            by: how much to add
        """
        self.count += by
        return self.count

    def get_reward(self) -> float:
        return float(self.count == 3)
'''


def spec(**environment: Any) -> Any:
    return demo_spec("agent-run", "file:///unused", environment=environment, eval={"split": None})


def code(source: str, entry_point: str) -> dict[str, Any]:
    return {"kind": "code", "source": source, "entry_point": entry_point}


@pytest.mark.parametrize(
    ("environment", "said"),
    [
        ({"kind": "builtin", "name": "abacus"}, "environment.name: unknown built-in environment 'abacus'; use one of"),
        ({"max_episode_tokens": 100}, "environment.max_episode_tokens: only for a run with tools"),
        ({"kind": "builtin", "packages": ["sympy==1.13.3"]}, "environment.packages: only for kind 'code'"),
        ({**code("x = 1", "x"), "packages": ["sympy"]}, "environment.packages: 'sympy' is not pinned; give each"),
        ({**code("x = 1", "x"), "packages": ["sympy>=1"]}, "environment.packages: 'sympy>=1' is not pinned"),
        ({"kind": "builtin", "max_episode_tokens": 1}, "environment.max_episode_tokens: Input should be greater than"),
        ({"kind": "code"}, "environment.source: kind 'code' needs Python code defining the tools"),
        (code(TOOLS, "add; shout"), "environment.entry_point: name the environment class, or the tool functions"),
        ({"kind": "builtin", "source": TOOLS}, "environment.source: only for kind 'code'"),
        ({"kind": "builtin", "max_turns": 0}, "environment.max_turns"),
        ({"kind": "builtin", "max_turns": 33}, "environment.max_turns"),
    ],
)
def test_environment_settings_that_cannot_work_are_named(environment: dict[str, Any], said: str) -> None:
    with pytest.raises(SpecError, match=re.escape(said)):
        spec(**environment)


def test_a_run_without_tools_passes_nothing_to_the_trainer(tmp_path: Path) -> None:
    assert trainer_arguments(spec().environment, tmp_path) == {}


def test_the_calculator_works_out_arithmetic_and_nothing_else() -> None:
    assert [calculate(e) for e in ("(3 + 4) * 12", "7 / 2", "-2 ** 3", "17 // 5", "2 ** 0.5")] == [
        "84",
        "3.5",
        "-8",
        "3",
        "1.41421",
    ]
    assert calculate("1 / 0") == "error: division by zero"
    for hostile in ('__import__("os").system("id")', "open('/etc/passwd')", "[1] * 10**9", "x + 1"):
        assert calculate(hostile).startswith("error: only numbers"), hostile
    assert calculate("9 ** 9 ** 9") == "error: the power is too large to work out"  # would take minutes of CPU


def test_the_built_in_calculator_is_given_to_the_trainer_as_a_tool_with_its_schema(tmp_path: Path) -> None:
    from transformers.utils import get_json_schema

    arguments = trainer_arguments(spec(kind="builtin", name="calculator").environment, tmp_path)
    assert arguments == {"tools": [calculate]}
    schema = get_json_schema(calculate)["function"]
    assert schema["name"] == "calculate" and schema["parameters"]["required"] == ["expression"]


def test_the_codebook_answers_only_about_the_thing_its_row_asks_about(tmp_path: Path) -> None:
    """The agent demo's environment: each row keeps its own code, so only a lookup of the row's thing answers it; it
    reaches the trainer as TRL's environment factory, and its rows start episodes as the preflight rehearses them."""
    from jobs.demo.dataset import codebook_rows
    from jobs.environments.codebook import Codebook
    from jobs.environments.loading import rehearse

    rows = codebook_rows("train")
    assert len(rows) == 64 and len(codebook_rows("test")) == 32
    assert {row["thing"] for row in rows if row["prompt"] == rows[0]["prompt"]} == {rows[0]["thing"]}
    assert len({row["answer"] for row in rows if row["thing"] == rows[0]["thing"]}) > 1  # no code to memorise
    book = Codebook()
    book.reset(**rows[0])
    assert book.lookup(rows[0]["thing"].upper()) == rows[0]["answer"]
    assert "no code is kept for 'moon'" in book.lookup("moon")
    arguments = trainer_arguments(spec(kind="builtin", name="codebook").environment, tmp_path)
    assert arguments == {"environment_factory": Codebook}
    assert rehearse(arguments, rows[:3]) == [
        "Codebook.reset(row) on 3 sample rows",
        "lookup(name='1') -> \"no code is kept for '1'; ask about " + repr(rows[2]["thing"]) + '"',
    ]


def test_tool_functions_and_an_environment_class_in_the_users_code_are_loaded_as_trl_takes_them(
    tmp_path: Path,
) -> None:
    import pickle

    tools = trainer_arguments(spec(**code(TOOLS, "add, shout")).environment, tmp_path / "tools")["tools"]
    assert [tool.__name__ for tool in tools] == ["add", "shout"] and tools[0](2, 3) == 5
    assert pickle.loads(pickle.dumps(tools[1]))("hi") == "HI"  # by module and name, as TRL's child imports them
    factory = trainer_arguments(spec(**code(ENVIRONMENT, "Counter")).environment, tmp_path / "env")[
        "environment_factory"
    ]
    episode = factory()
    assert episode.reset(prompt="count") == "Count to three." and episode.increment(3) == 3
    assert episode.get_reward() == 1.0


def test_code_unloaded_from_its_folder_leaves_code_loaded_from_another_since_in_place(tmp_path: Path) -> None:
    """An agent's code goes with it (jobs/evaluation/episodes.py): its folder off the import path, its module
    forgotten; but not the module another folder's code was loaded into since, which that code pickles by."""
    import sys

    from jobs.environments.loading import CODE_MODULE, load_code, unload_code

    first, second = tmp_path / "first", tmp_path / "second"
    load_code(TOOLS, ["add"], first)
    shout = load_code(TOOLS, ["shout"], second)[0]
    unload_code(first)
    assert str(first) not in sys.path and sys.modules[CODE_MODULE].shout is shout
    unload_code(second)
    assert str(second) not in sys.path and CODE_MODULE not in sys.modules


NO_DOCSTRING = "def add(a: int, b: int) -> int:\n    return a + b\n"
NO_HINT = 'def add(a, b):\n    """Add.\n\n    Args:\n        a: one\n        b: two\n    """\n    return a + b\n'
LAMBDA = "add = lambda a, b: a + b\n"
NO_RESET = ENVIRONMENT.replace("def reset(self, **row)", "def start(self, **row)")
ONLY_RESET = "class Empty:\n    def reset(self, **row):\n        return None\n"


SECOND_ENVIRONMENT = '''
class Echo:
    def reset(self, **row):
        return None

    def echo(self, text: str) -> str:
        """Say it back.

        Args:
            text: what to say
        """
        return text
'''


def test_several_environment_classes_give_each_row_the_one_its_environment_column_names(tmp_path: Path) -> None:
    """TRL's environment per row: the classes reach the trainer as a dict by name; each row's prompt is measured with
    its own environment's tools only (as TRL renders it); rows naming no known environment are refused before the
    run, and every environment starts episodes from its own rows."""
    from transformers import AutoTokenizer

    from jobs.environments.loading import check_environment_column, rehearse, row_tools
    from jobs.models import builtin_model_folder
    from jobs.trainer.dataset import build_prompts, prompt_token_ids

    source = ENVIRONMENT + SECOND_ENVIRONMENT
    arguments = trainer_arguments(spec(**code(source, "Counter, Echo")).environment, tmp_path)
    factories = arguments["environment_factory"]
    assert list(factories) == ["Counter", "Echo"]
    rows = [
        {"prompt": "Count.", "answer": "", "environment": "Counter"},
        {"prompt": "Say hi.", "answer": "", "environment": "Echo"},
    ]
    tools_of = row_tools(arguments)
    assert [[t.__name__ for t in tools_of(row)] for row in rows] == [["increment"], ["echo"]]
    assert rehearse(arguments, rows) == [
        "Counter.reset(row) on 1 sample rows",
        "increment(by=1) -> '1'",
        "Echo.reset(row) on 1 sample rows",
        "echo(text='1') -> '1'",
    ]
    for bad, said in (({"environment": "Abacus"}, "row 2 names environment 'Abacus'"), ({}, "row 2 has no")):
        with pytest.raises(EnvironmentCodeError, match=said):
            check_environment_column(arguments, [rows[0], {"prompt": "?", **bad}])
    import datasets

    # The trainer's training set is checked by the column's distinct values, no row read one by one (a large
    # dataset's every row made a dict); the first bad row is named as above.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets.Dataset, "__iter__", lambda self: pytest.fail("every row was read"))
        check_environment_column(arguments, datasets.Dataset.from_list(rows * 3))
    named_badly = datasets.Dataset.from_list([*rows, {**rows[0], "environment": "Abacus"}])
    with pytest.raises(EnvironmentCodeError, match="row 3 names environment 'Abacus'"):
        check_environment_column(arguments, named_badly)
    unnamed = datasets.Dataset.from_list([{"prompt": row["prompt"], "answer": ""} for row in rows])
    with pytest.raises(EnvironmentCodeError, match="row 1 has no environment column"):
        check_environment_column(arguments, unnamed)

    tokenizer = AutoTokenizer.from_pretrained(builtin_model_folder(DEMO_MODEL_ID))
    run = spec(**code(source, "Counter, Echo"))
    measured = [len(prompt_token_ids(tokenizer, [{"role": "user", "content": r["prompt"]}], tools_of(r))) for r in rows]
    room = max(measured) - 1  # room for the shorter prompt with its own tools only
    kept = build_prompts(run.dataset, datasets.Dataset.from_list(rows), tokenizer, room, tools_of)
    assert [row["environment"] for row in kept] == [rows[measured.index(min(measured))]["environment"]]


@pytest.mark.parametrize(
    ("source", "entry_point", "said"),
    [
        ("import nonexistent_package\n", "add", "environment.source: the code failed when imported: ModuleNotFound"),
        (TOOLS, "add, multiply", "environment.entry_point: multiply not defined in the code"),
        (NO_DOCSTRING, "add", "environment.source: tool add: Cannot generate JSON schema for add because it has no "),
        (NO_HINT, "add", "environment.source: tool add: "),
        (LAMBDA, "add", "environment.entry_point: a <lambda> is no tool; TRL registers each tool under its function"),
        (TOOLS + "shout = 'loud'\n", "shout", "environment.entry_point: 'loud' is not a function"),
        (NO_RESET, "Counter", "environment.source: Counter has no reset method; define reset(self, **row)"),
        (ONLY_RESET, "Empty", "environment.source: Empty has no public method besides reset and get_reward"),
        (
            ENVIRONMENT + TOOLS,
            "Counter, add",
            "environment.entry_point: name environment classes (several: one per row",
        ),
    ],
)
def test_environment_code_that_trl_could_not_use_is_refused_naming_the_tool_and_the_fix(
    tmp_path: Path, source: str, entry_point: str, said: str
) -> None:
    with pytest.raises(EnvironmentCodeError, match=re.escape(said)):
        trainer_arguments(spec(**code(source, entry_point)).environment, tmp_path)


def test_an_agent_run_needs_a_chat_template_trl_reads_tool_calls_in() -> None:
    from trl.chat_template_utils import qwen3_instruct_2507_chat_template

    chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    assert response_template(chatml, "org/chatml-model") is not None  # text replies: read with the recipe's template
    with pytest.raises(ChatTemplateError, match="cannot read tool calls in org/chatml-model's chat template"):
        response_template(chatml, "org/chatml-model", tools=True)
    assert response_template(qwen3_instruct_2507_chat_template, "demo", tools=True) is None  # the demo model's


def test_the_trainer_is_told_how_many_tool_turns_an_episode_may_take(tmp_path: Path) -> None:
    from jobs.trainer.config import grpo_config

    agent = grpo_config(spec(kind="builtin", max_turns=3), str(tmp_path), "http://127.0.0.1:9", cuda=False)
    assert agent.max_tool_calling_iterations == 3
    single = grpo_config(spec(), str(tmp_path), "http://127.0.0.1:9", cuda=False)
    assert single.max_tool_calling_iterations is None


def test_prompts_are_measured_with_the_tools_schemas_trl_renders_into_them() -> None:
    """The calculator's schema takes the demo's prompts from ~30 tokens to ~660: at the demo's 512-token context
    every one is too long, which the replicas refused with a bare 400 on every request until the rollout child gave
    up. The trainer drops such prompts and, when none is left, says so before training."""
    from transformers import AutoTokenizer

    from jobs.chat_templates import fit_tokenizer
    from jobs.models import resolve_model
    from jobs.trainer.dataset import DatasetError, build_prompts, load_rows, prompt_token_ids

    run = spec(kind="builtin", name="calculator")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(run.model))
    fit_tokenizer(tokenizer, run.model.id, tools=True)
    rows = load_rows(run.dataset, limit=4)
    messages = [{"role": "user", "content": "Write some numbers. apple"}]
    alone, offered = prompt_token_ids(tokenizer, messages), prompt_token_ids(tokenizer, messages, [calculate])
    assert len(offered) > len(alone) + 300
    room = run.model.max_model_len - run.grpo.max_completion_length
    assert len(build_prompts(run.dataset, rows, tokenizer, room)) == len(rows)  # without tools, all fit
    with pytest.raises(DatasetError, match=f"every prompt with the tools' schemas is longer than {room} tokens"):
        build_prompts(run.dataset, rows, tokenizer, room, lambda row: [calculate])
    assert len(build_prompts(run.dataset, rows, tokenizer, 1024 - 16, lambda row: [calculate])) == len(rows)


HOSTILE_PROGRAMS = {  # what the model's program tries -> what the Python tool answers
    "open a connection": ("import socket\nsocket.create_connection(('example.com', 80))", "may not resolve host names"),
    "start a process": ("import subprocess\nsubprocess.run(['id'])", "may not start processes"),
    "fork": ("import os\nos.fork()", "may not fork"),
    "call libc through ctypes": ("import ctypes\nctypes.CDLL(None).fork()", "may not load C libraries"),
    "read a file outside its folder": ("print(open('/etc/passwd').read())", "PermissionError"),
    "write a file outside its folder": ("open('/tmp/escaped.txt', 'w').write('x')", "PermissionError"),
    "exhaust the CPU": ("while True:\n    pass", "used more than 5 s of CPU and was stopped"),
    "exhaust memory": ("x = bytearray(2 ** 31)", "MemoryError"),
    "exit": ("raise SystemExit(3)", "error: SystemExit: 3"),
}


@pytest.mark.parametrize("attempt", list(HOSTILE_PROGRAMS))
def test_the_python_tool_runs_the_models_program_confined_and_answers_in_text(attempt: str) -> None:
    """Issue 31: the `python` built-in runs what the model wrote under the reward sandbox's confinement (one copy,
    jobs/confinement); every attempt the hostile-reward table makes is refused or stopped, and said as text the model
    reads on its next turn, never raised into the episode."""
    from jobs.environments.python import run_python

    program, answer = HOSTILE_PROGRAMS[attempt]
    assert answer in run_python(program)
    assert not Path("/tmp/escaped.txt").exists()


def test_the_python_tool_returns_what_the_program_prints_and_keeps_its_own_folder() -> None:
    from jobs.environments.python import MAX_OUTPUT_CHARS, run_python

    assert run_python("print(sum(range(10)))") == "45"
    assert run_python("open('notes.txt', 'w').write('kept')\nprint(open('notes.txt').read())") == "kept"
    assert run_python("x = 1") == "(the program printed nothing)"
    assert run_python("print(1)\n1 / 0") == "1\nerror: ZeroDivisionError: division by zero"
    assert len(run_python("print('x' * 100_000)")) == MAX_OUTPUT_CHARS  # the model's next prompt stays short


def test_an_episode_is_recorded_turn_by_turn_for_the_sample_browser() -> None:
    """What TRL hands over for an agent's episode (one message list: replies, tool calls, tool answers) is recorded as
    readable turns, so the sample browser shows and searches each; a single-turn reply stays its text."""
    from jobs.trainer.telemetry import episode_text

    episode = [
        {
            "role": "assistant",
            "content": "Let me work it out.",
            "tool_calls": [{"type": "function", "function": {"name": "calculate", "arguments": {"expression": "6*7"}}}],
        },
        {"role": "tool", "name": "calculate", "content": "42"},
        {"role": "assistant", "content": "The answer is 42."},
    ]
    assert episode_text(episode) == (
        "Let me work it out.\n→ calculate(expression='6*7')\n← calculate: 42\nThe answer is 42."
    )
    assert episode_text([{"role": "assistant", "content": "just 42"}]) == "just 42"


def test_each_reply_of_an_episode_keeps_the_version_its_request_named() -> None:
    """The job's rollout loop notes on each reply the adapter version whose name its request carried; the episode's
    turns carry it to the panel, so a turn generated after a mid-episode sync shows its own version."""
    from jobs.trainer.episode_loop import TURN_VERSION, version_named
    from jobs.trainer.telemetry import episode_turns

    assert [version_named(name) for name in ("trl-policy-v12", "trl-policy-v", "Qwen/Qwen2.5-0.5B")] == [12, None, None]
    call = {"type": "function", "function": {"name": "lookup", "arguments": {"name": "apple"}}}
    episode = [
        {"role": "assistant", "content": "", "tool_calls": [call], TURN_VERSION: 5},
        {"role": "tool", "name": "lookup", "content": "7"},
        {"role": "assistant", "content": "7", TURN_VERSION: 6},
    ]
    assert episode_turns(episode) == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"name": "lookup", "arguments": {"name": "apple"}}],
            "version": 5,
        },
        {"role": "tool", "name": "lookup", "content": "7"},
        {"role": "assistant", "content": "7", "tool_calls": [], "version": 6},
    ]
    assert episode_turns([{"role": "assistant", "content": "7"}]) is None  # a single reply has no turns


def test_an_episode_keeps_to_its_token_budget_and_keeps_one_token_for_a_last_turn() -> None:
    """Each turn is asked for what TRL asks, within what the episode has left less one token; once one token is left,
    the turn gets that one token (it cannot be a tool call, so the episode ends) and the episode counts as ended by
    its budget. Without a budget, turns are asked for what TRL asks."""
    from jobs.trainer.episode_loop import Episode

    episode, asked = Episode(tokens_left=40), []
    for generated in (32, 7, 1):
        asked.append(episode.max_tokens(32))
        assert not episode.ended_by_budget or asked[-1] == 1
        episode.spent(generated)
    assert asked == [32, 7, 1] and episode.ended_by_budget and episode.tokens_left == 0
    short = Episode(tokens_left=40)
    assert short.max_tokens(16) == 16 and not short.ended_by_budget
    free = Episode(tokens_left=None)
    free.spent(1000)
    assert free.max_tokens(32) == 32 and not free.ended_by_budget


def test_the_plan_says_what_an_agent_run_offers_and_how_many_episodes_run_at_once(tmp_path: Path) -> None:
    from backend.launch.plan import derived_values
    from jobs.replica.engine_command import EngineChoice

    OURS = EngineChoice("cpu", "the engine does not matter to these checks")

    agent = derived_values(spec(kind="builtin", name="python", max_turns=3), trainer_cuda=False, engine=OURS)["tools"]
    assert agent == {
        "environment": "python",
        "offers": "run_python(code): what a Python program prints, run confined (no network, no processes)",
        "max_turns": 3,
        "episode_tokens": 64,  # the demo's 16 tokens a turn, over the first turn and 3 tool turns
        "episode_tokens_from": "no budget: 16 tokens x 4 turns",
        "episodes_in_flight": 32,
        "packages": [],
    }
    budgeted = spec(kind="builtin", name="python", max_turns=3, max_episode_tokens=40)
    assert derived_values(budgeted, trainer_cuda=False, engine=OURS)["tools"]["episode_tokens"] == 40
    assert derived_values(spec(), trainer_cuda=False, engine=OURS)["tools"] is None


def test_packages_the_environment_imports_are_installed_by_a_job_that_lacks_them_and_left_untried_by_the_panel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The HF Jobs branch, driven here: the panel lacks a package the code imports, so its code is said to be
    untried (not refused: the trainer installs it), and a trainer whose pip cannot reach it names the package."""
    from backend.launch.preflight import Preflight, environment_packages_here
    from backend.launch.presets import math_recipe
    from jobs.contract import parse_spec
    from jobs.pins import install_missing, installed, missing

    torch_pin = f"torch=={installed('torch')}"
    assert missing([torch_pin, "no-such-package-xyz==1.0", "torch==0.0.1"]) == [
        "no-such-package-xyz==1.0",
        "torch==0.0.1",
    ]
    data = math_recipe("agent-hub", "someone", "grpo")
    data |= {"environment": {**code("x = 1", "x"), "packages": [torch_pin, "no-such-package-xyz==1.0"]}, "eval": {}}
    result = Preflight()
    assert not environment_packages_here(parse_spec(data), result)
    assert (
        not result.errors
        and "no-such-package-xyz==1.0, which this panel lacks" in result.unchecked["environment.source"]
    )
    data["environment"]["packages"] = [torch_pin]
    assert environment_packages_here(parse_spec(data), Preflight())
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip fails at once instead of searching the registry
    with pytest.raises(RuntimeError, match=r"could not install no-such-package-xyz==1\.0 for the environment"):
        install_missing(["no-such-package-xyz==1.0", torch_pin], "for the environment's code")
    assert install_missing([torch_pin], "for the environment's code") == []


def test_reset_is_rehearsed_as_trl_calls_it_and_what_it_returns_must_fit_a_prompt(tmp_path: Path) -> None:
    """With one environment class TRL passes reset the whole row, an `environment` column included (only with
    several is that column TRL's own); and TRL appends what reset returns to the prompt, so a dict would fail
    there, after the replicas started."""
    from jobs.environments.loading import rehearse

    strict = ENVIRONMENT.replace("def reset(self, **row):", "def reset(self, prompt, answer):")
    arguments = trainer_arguments(spec(**code(strict, "Counter")).environment, tmp_path / "one")
    with pytest.raises(EnvironmentCodeError, match="Counter.reset failed on a sample row: TypeError"):
        rehearse(arguments, [{"prompt": "Count.", "answer": "", "environment": "Counter"}])
    returns_dict = ENVIRONMENT.replace('return "Count to three."', 'return {"task": "count"}')
    arguments = trainer_arguments(spec(**code(returns_dict, "Counter")).environment, tmp_path / "dict")
    with pytest.raises(EnvironmentCodeError, match="Counter.reset returned a dict; TRL appends what reset returns"):
        rehearse(arguments, [{"prompt": "Count.", "answer": ""}])
