"""The run's environment as TRL's trainer takes it, checked the way TRL will use it before anything trains.

TRL builds each tool's schema from its name, type hints and Google-style docstring, and pickles the tools (or the
environment class) to its spawned rollout child, which imports them by module and name. A user's code is therefore
written to a module of its own in a folder put on `sys.path` (the spawned child inherits it), and every tool is
given to transformers' schema builder here, so a missing docstring or type hint is said with the tool's name rather
than raised in the child after the replicas started billing.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import pickle
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobs.contract import EnvironmentSpec

if TYPE_CHECKING:
    from datasets import Dataset

CODE_MODULE = "run_environment"  # the module a user's environment code is written to
NOT_TOOLS = ("reset", "get_reward")  # an environment's public methods that TRL does not offer as tools
ENVIRONMENT_COLUMN = "environment"  # the dataset column naming each row's environment, where there are several


class EnvironmentCodeError(ValueError):
    """The environment cannot be used as written; the message names the field, the tool and the fix."""


def trainer_arguments(spec: EnvironmentSpec, folder: Path) -> dict[str, Any]:
    """`tools=` or `environment_factory=` for `AsyncGRPOTrainer`, checked; none for a single-turn run. Several
    environment classes make a dict by class name, as TRL takes an environment per row (the dataset's `environment`
    column names each row's). A user's code is written under `folder`."""
    if not spec.enabled:
        return {}
    if spec.kind == "builtin":
        module = importlib.import_module(f"jobs.environments.{spec.name}")
        if hasattr(module, "ENVIRONMENT"):
            return {"environment_factory": checked_environment(module.ENVIRONMENT)}
        return {"tools": checked_tools(list(module.TOOLS))}
    loaded = load_code(spec.source or "", spec.entry_points, folder)
    if not inspect.isclass(loaded[0]):
        return {"tools": checked_tools(loaded)}
    if len(loaded) == 1:
        return {"environment_factory": checked_environment(loaded[0])}
    return {"environment_factory": {factory.__name__: checked_environment(factory) for factory in loaded}}


SAMPLE_ARGUMENTS: dict[str, Any] = {
    "string": "1",
    "integer": 1,
    "number": 1.0,
    "boolean": True,
    "array": [],
    "object": {},
}


def rehearse(arguments: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """Start an episode from each sample row (an environment's `reset(**row)`; with an environment per row, the one
    the row names) and call every tool once with arguments made from its schema, as a model would; returns the calls
    made, in words. A tool may answer a made-up argument with an error (the model is shown it), but must not raise,
    which would end the episode."""
    factories = environment_factories(arguments)
    if factories is None:
        return _call_tools(list(arguments.get("tools", [])))
    check_environment_column(arguments, rows)
    said: list[str] = []
    for name, factory in factories.items():
        mine = [row for row in rows if name is None or row.get(ENVIRONMENT_COLUMN) == name]
        instance = factory()
        said += _start_episodes(factory.__name__, instance, mine, per_row=name is not None)
        said += _call_tools(environment_tools(instance))
    return said


def environment_factories(arguments: dict[str, Any]) -> dict[str | None, Callable[[], Any]] | None:
    """The environment classes of `trainer_arguments`' result by the name rows select them by (None: the one every
    row uses); None for tool functions or no tools."""
    factory = arguments.get("environment_factory")
    if factory is None:
        return None
    return dict(factory) if isinstance(factory, dict) else {None: factory}


def check_environment_column(arguments: dict[str, Any], rows: Dataset | list[dict[str, Any]]) -> None:
    """With an environment per row, every row names one of them in its `environment` column (TRL stops the run at
    the first row that does not, after the replicas started). Of a training set (a `Dataset`) only the column's
    distinct values are read, not a dict made of every row; the rows one by one only when one of them names no
    environment, to say which."""
    factories = environment_factories(arguments)
    if factories is None or None in factories:
        return
    if (
        not isinstance(rows, list)
        and ENVIRONMENT_COLUMN in rows.column_names
        and all(name in factories for name in rows.unique(ENVIRONMENT_COLUMN))
    ):
        return
    names = ", ".join(str(name) for name in factories)
    for number, row in enumerate(rows, 1):
        if row.get(ENVIRONMENT_COLUMN) not in factories:
            found = (
                "has no environment column"
                if ENVIRONMENT_COLUMN not in row
                else (f"names environment {row[ENVIRONMENT_COLUMN]!r}")
            )
            raise EnvironmentCodeError(
                f"environment.entry_point: dataset row {number} {found}; with several environment classes, each row "
                f"names its own in an '{ENVIRONMENT_COLUMN}' column: one of {names}"
            )


def row_tools(arguments: dict[str, Any]) -> Callable[[dict[str, Any]], list[Callable[..., Any]]]:
    """For each row, the tools the model is offered on it (TRL renders their schemas into its prompt): the tool
    functions, the environment's, or with an environment per row, those of the one the row names. Each environment
    is built once here, not once per row: a user's may be costly to build."""
    factories = environment_factories(arguments)
    if factories is None:
        tools = list(arguments.get("tools", []))
        return lambda row: tools
    offered = {name: environment_tools(factory()) for name, factory in factories.items()}
    if None in offered:
        return lambda row: offered[None]
    return lambda row: offered.get(row.get(ENVIRONMENT_COLUMN), [])


def _call_tools(tools: list[Callable[..., Any]]) -> list[str]:
    said = []
    for tool in tools:
        parameters = tool_schema(tool)["function"].get("parameters", {})
        sample = {
            name: SAMPLE_ARGUMENTS.get(str(field.get("type")), "1")
            for name, field in parameters.get("properties", {}).items()
        }
        try:
            answer = tool(**sample)
        except Exception as error:
            raise EnvironmentCodeError(
                f"environment.source: tool {tool.__name__}({_call(sample)}) raised {type(error).__name__}: {error}; "
                "a tool should return what went wrong as text the model can read"
            ) from None
        said.append(f"{tool.__name__}({_call(sample)}) -> {str(answer)[:80]!r}")
    return said


def _start_episodes(name: str, instance: Any, rows: list[dict[str, Any]], per_row: bool) -> list[str]:
    """`reset(**row)` on each sample row, as TRL starts an episode (with an environment per row, the `environment`
    column is TRL's and reset does not get it), and what it returns is something TRL can add to the prompt."""
    for row in rows:
        try:
            observation = instance.reset(**{k: v for k, v in row.items() if not (per_row and k == ENVIRONMENT_COLUMN)})
        except Exception as error:
            raise EnvironmentCodeError(
                f"environment.source: {name}.reset failed on a sample row: {type(error).__name__}: {error}"
            ) from None
        if observation is not None and not isinstance(observation, str | list):
            raise EnvironmentCodeError(
                f"environment.source: {name}.reset returned a {type(observation).__name__}; TRL appends what reset "
                "returns to the prompt: return None, or the text to append"
            )
    return [f"{name}.reset(row) on {len(rows)} sample rows"]


def _call(arguments: dict[str, Any]) -> str:
    return ", ".join(f"{name}={value!r}" for name, value in arguments.items())


def load_code(source: str, names: list[str], folder: Path) -> list[Any]:
    """The objects `names` in the user's environment `source`, imported from a module of their own."""
    if not folder.is_dir():  # the reward sandbox gives its scratch folder, where no folder may be made
        folder.mkdir(parents=True)
    (folder / f"{CODE_MODULE}.py").write_text(source)
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    sys.modules.pop(CODE_MODULE, None)
    try:
        module = importlib.import_module(CODE_MODULE)
    except Exception as error:
        raise EnvironmentCodeError(
            f"environment.source: the code failed when imported: {type(error).__name__}: {error}"
        ) from None
    missing = [name for name in names if not hasattr(module, name)]
    if missing:
        raise EnvironmentCodeError(
            f"environment.entry_point: {', '.join(missing)} not defined in the code; name the environment class, or "
            "the tool functions separated by commas"
        )
    loaded = [getattr(module, name) for name in names]
    classes = [item for item in loaded if inspect.isclass(item)]
    if classes and len(classes) < len(loaded):
        raise EnvironmentCodeError(
            "environment.entry_point: name environment classes (several: one per row, by the dataset's "
            f"'{ENVIRONMENT_COLUMN}' column), or only tool functions, not both"
        )
    return loaded


def unload_code(folder: Path) -> None:
    """Undo `load_code` from `folder`: its module forgotten (unless code from another folder was loaded since) and the
    folder off the import path, so neither keeps the user's code alive nor shadows code loaded after it."""
    module = sys.modules.get(CODE_MODULE)
    if module is not None and getattr(module, "__file__", None) == str(folder / f"{CODE_MODULE}.py"):
        del sys.modules[CODE_MODULE]
    with contextlib.suppress(ValueError):
        sys.path.remove(str(folder))


def checked_tools(tools: list[Callable[..., Any]]) -> list[Callable[..., Any]]:
    """`tools`, once each has a schema TRL can build and pickles as TRL sends it."""
    if not tools:
        raise EnvironmentCodeError("environment.entry_point: name at least one tool function")
    for tool in tools:
        if not inspect.isfunction(tool):
            raise EnvironmentCodeError(
                f"environment.entry_point: {getattr(tool, '__name__', tool)!r} is not a function; tools are "
                "module-level functions (or name one environment class)"
            )
        if not tool.__name__.isidentifier():
            raise EnvironmentCodeError(
                f"environment.entry_point: a {tool.__name__} is no tool; TRL registers each tool under its function's "
                "name and sends it to its rollout process by that name: define it with def at module level"
            )
        tool_schema(tool)
        _pickles(tool, tool.__name__)
    return tools


def checked_environment(factory: type) -> type:
    """An environment class, once it builds, has `reset`, offers at least one tool with a schema, and pickles."""
    name = factory.__name__
    try:
        instance = factory()
    except Exception as error:
        raise EnvironmentCodeError(
            f"environment.source: {name}() failed: {type(error).__name__}: {error}; TRL builds one per episode "
            "with no arguments, and passes the dataset row to reset"
        ) from None
    if not callable(getattr(instance, "reset", None)):
        raise EnvironmentCodeError(
            f"environment.source: {name} has no reset method; define reset(self, **row) to start an episode from a "
            "dataset row"
        )
    tools = environment_tools(instance)
    if not tools:
        raise EnvironmentCodeError(
            f"environment.source: {name} has no public method besides reset and get_reward; its public methods are "
            "the tools"
        )
    for tool in tools:
        tool_schema(tool)
    _pickles(factory, name)
    return factory


def environment_tools(instance: object) -> list[Callable[..., Any]]:
    """The tools an environment offers, as TRL finds them: its public methods but reset and get_reward."""
    return [
        getattr(instance, name)
        for name in dir(instance)
        if not name.startswith("_") and name not in NOT_TOOLS and inspect.ismethod(getattr(instance, name))
    ]


def tool_schema(tool: Callable[..., Any]) -> dict[str, Any]:
    """The schema the model is shown for `tool`, as TRL builds it (transformers' `get_json_schema`)."""
    from transformers.utils import get_json_schema

    try:
        return dict(get_json_schema(tool))
    except Exception as error:
        raise EnvironmentCodeError(
            f"environment.source: tool {tool.__name__}: {error}; give every parameter a type hint and the tool a "
            "Google-style docstring with an Args: section describing each parameter (the model is shown them)"
        ) from None


def _pickles(item: object, name: str) -> None:
    try:
        pickle.dumps(item)
    except Exception as error:
        raise EnvironmentCodeError(
            f"environment.source: {name} cannot be sent to TRL's rollout process ({type(error).__name__}: {error}); "
            "define tools and the environment class at module level, not as lambdas or closures"
        ) from None
