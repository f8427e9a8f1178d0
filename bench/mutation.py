"""Mutation testing: how many small bugs planted in the proxy's membership and adapter code, the poller and ingest,
and the launch form's error routing the tests catch, and which ones they miss.

    .venv/bin/python bench/mutation.py                                  # every target: hours on 2 cores (below)
    .venv/bin/python bench/mutation.py --target launch-form-errors --json figures.json
    .venv/bin/python bench/mutation.py --source /tmp/old-checkout       # the same figures for an older tree
    .venv/bin/python bench/mutation.py --target proxy-membership --sample 5    # a tenth of the mutants, ~10x quicker

mutmut 3.8.1 comes with requirements-dev.txt (scripts/setup dev); it is run here, never in CI.
For each target the source tree is copied (without .venv, data/, mutants/, .git and caches) to a temporary folder; the
mutmut configuration is written into that copy's pyproject.toml only, and `mutmut run --max-children 1` runs there
(PYTHONPATH unset), so neither the working tree nor the tree given with --source is touched. mutmut copies the
packages into `mutants/`, plants one mutant per small change (an operator, a constant, a string, a call argument...)
in each function of the target's modules, and for each mutant runs only the target's tests that executed that
function in the pytest process, stopping at the first failure. Code that only a subprocess of a test executes counts
as reached by no test; a subprocess started from the repository root (tests run with cwd `mutants/`) does run the
mutant, so it can still kill one that an in-process test reaches too. Hypothesis runs derandomized and without its
example database (a profile loaded by a plugin written into the copy), so a verdict does not depend on luck or on
which mutants ran before. The launch form's target mutates only `FormSchema.slot_of`, `FormSchema.route_errors`
and the functions and methods they call: mutmut 3 selects mutants by name, so it generates the whole file's but runs
and counts only those.

Per target it prints the number of mutants and how many were killed, survived, timed out, were suspicious or reached
by no selected test, the mutation score (SCORE below) and every surviving mutant with its change on one line, for a
developer to decide whether a test should pin that behaviour down. A target's test files or modules that do not exist
in the source tree are left out (an older checkout has fewer). --sample keeps the mutants whose number ends in the
given digits: an unbiased estimate in a fraction of the time. With one worker on this 2-core machine a tenth of
proxy-membership (~125 mutants) took 18 minutes, a fifth of poller-ingest (~220) 27 minutes and the whole of
launch-form-errors (181) 7 minutes; the tests mostly wait on loopback servers and timers, so the time is wall-clock.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import fnmatch
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mutmut.mutation.diff_apply import get_diff_for_mutant
from mutmut.stats import status_by_exit_code

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "backend", "jobs")  # mutmut's source_paths: copied whole into mutants/, so imports resolve there
NOT_COPIED = (".venv", "data", "mutants", ".git", "__pycache__", ".hypothesis", ".pytest_cache", ".ruff_cache")
STATUSES = ("killed", "survived", "timeout", "suspicious", "segfault", "no tests", "not checked")
DETECTED = ("killed", "timeout")
NOT_RUN = ("no tests", "not checked")
SCORE = (
    "score = (killed + timeout) / (mutants - no tests - not checked): of the mutants that at least one selected "
    "test executes, the share that makes a test fail or hang"
)
HYPOTHESIS_PLUGIN = "mutation_hypothesis_profile"
HYPOTHESIS_PROFILE = """from hypothesis import settings

settings.register_profile("mutation", derandomize=True, database=None)
settings.load_profile("mutation")
"""


@dataclass(frozen=True)
class Target:
    name: str
    modules: tuple[str, ...]  # files to mutate, as globs: those missing from the source tree are left out
    tests: tuple[str, ...]  # test files, as globs: those missing from the source tree are left out
    env: dict[str, str] = field(default_factory=dict)
    roots: tuple[str, ...] = ()  # if set: mutate only these functions and the module-level functions they call


TARGETS = (
    Target(
        "proxy-membership",
        modules=("jobs/proxy/upstreams.py", "jobs/proxy/adapters.py"),
        tests=("tests/jobs/test_proxy_*.py",),
    ),
    Target(
        "poller-ingest",
        modules=(
            "backend/ingestion/poller.py",
            "backend/ingestion/streams.py",
            "backend/ingestion/versions.py",
            "backend/ingestion/job_stages.py",
            "backend/ingestion/run_status.py",
            "backend/ingestion/cost_cap.py",
            "backend/ingestion/ingest.py",
            "backend/database/cursors.py",
        ),
        tests=("tests/backend/test_poller.py", "tests/backend/test_poller_interleavings.py"),
        env={"GRPO_INTERLEAVING_EXAMPLES": "8"},
    ),
    Target(
        "launch-form-errors",
        modules=("app/launch_form.py",),
        tests=("tests/app/test_form_errors.py", "tests/test_bad_input.py"),
        roots=("FormSchema.slot_of", "FormSchema.route_errors"),
    ),
)


@dataclass
class Survivor:
    name: str
    function: str
    change: str


@dataclass
class Figures:
    target: str
    source: str
    modules: list[str]
    functions: list[str]  # empty: whole modules
    sample: str  # the --sample digits, empty for every mutant
    tests: list[str]
    mutants: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    score: float | None = None
    wall_s: float = 0.0
    survivors: list[Survivor] = field(default_factory=list)
    no_tests_by_function: dict[str, int] = field(default_factory=dict)
    error: str = ""


# -- the copy and its configuration ------------------------------------------------------------------------------------


def existing(tree: Path, patterns: tuple[str, ...]) -> list[str]:
    return sorted({str(path.relative_to(tree)) for pattern in patterns for path in tree.glob(pattern)})


def called_functions(source: str, roots: tuple[str, ...]) -> list[str]:
    """`roots` (functions, or methods as `Class.method`) and every module-level function and method of the same
    class they call (`self.method(...)`), directly or through each other."""
    tree = ast.parse(source)
    defs: dict[str, ast.FunctionDef] = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            defs.update({f"{node.name}.{item.name}": item for item in node.body if isinstance(item, ast.FunctionDef)})
    found: set[str] = set()
    pending = [name for name in roots if name in defs]
    while pending:
        name = pending.pop()
        if name in found:
            continue
        found.add(name)
        owner = name.rpartition(".")[0]
        for call in (node for node in ast.walk(defs[name]) if isinstance(node, ast.Call)):
            if isinstance(call.func, ast.Name) and call.func.id in defs:
                pending.append(call.func.id)
            elif isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name):
                method = f"{owner}.{call.func.attr}"
                if owner and call.func.value.id == "self" and method in defs:
                    pending.append(method)
    return sorted(found)


def mutant_patterns(modules: list[str], functions: list[str], sample: str) -> list[str]:
    """mutmut's filter: the mutants of `functions` (all if none), of those numbered ending in a digit of `sample`."""
    ending = f"[{sample}]" if sample else ""
    dotted = [module.removesuffix(".py").replace("/", ".") for module in modules]
    if not functions:
        return [f"{module}.*__mutmut_*{ending}" for module in dotted] if sample else []
    return [f"{module}.{_mangled(name)}__mutmut_*{ending}" for module in dotted for name in functions]


def _mangled(function: str) -> str:
    """mutmut's name for a function (`x_slot_of`) or a method (`xǁFormSchemaǁslot_of`)."""
    owner, _, name = function.rpartition(".")
    return f"xǁ{owner}ǁ{name}" if owner else f"x_{name}"


def copy_tree(source: Path, destination: Path) -> None:
    shutil.copytree(source, destination, ignore=shutil.ignore_patterns(*NOT_COPIED), symlinks=True)
    (destination / f"{HYPOTHESIS_PLUGIN}.py").write_text(HYPOTHESIS_PROFILE)


def toml_list(values: list[str]) -> str:
    return json.dumps(values)  # a JSON list of strings is a TOML array


def write_config(tree: Path, modules: list[str], tests: list[str]) -> None:
    also_copy = sorted(entry.name for entry in tree.iterdir() if entry.name not in PACKAGES)
    config = {
        "source_paths": toml_list(list(PACKAGES)),
        "only_mutate": toml_list(modules),
        "also_copy": toml_list(also_copy),
        "pytest_add_cli_args_test_selection": toml_list(tests),
        "pytest_add_cli_args": toml_list(["-p", HYPOTHESIS_PLUGIN]),
        "process_isolation": '"forkserver"',  # tests start servers and threads: fork mutants from a clean process
        "use_git_change_detection": "false",
    }
    with open(tree / "pyproject.toml", "a") as pyproject:
        pyproject.write("\n[tool.mutmut]\n" + "".join(f"{key} = {value}\n" for key, value in config.items()))


# -- running mutmut and reading what it wrote -------------------------------------------------------------------------


def run_mutmut(tree: Path, patterns: list[str], env: dict[str, str], log: Path) -> str:
    """Run `mutmut run` in `tree`; an empty string if it finished, else the end of its output."""
    environ = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"} | env
    command = [str(Path(sys.executable).with_name("mutmut")), "run", "--max-children", "1", *patterns]
    with open(log, "w") as output:
        code = subprocess.run(command, cwd=tree, env=environ, stdout=output, stderr=subprocess.STDOUT).returncode
    if code == 0:
        return ""
    lines = log.read_text(errors="replace").replace("\r", "\n").splitlines()
    return f"mutmut exited {code}: " + " | ".join(line.strip() for line in lines[-8:] if line.strip())


def verdicts(tree: Path, modules: list[str], patterns: list[str]) -> dict[str, tuple[str, str]]:
    """{mutant name: (module, status)} from the meta files mutmut writes beside each mutated file."""
    found = {}
    for module in modules:
        meta = json.loads((tree / "mutants" / f"{module}.meta").read_text())
        for name, exit_code in meta["exit_code_by_key"].items():
            if not patterns or any(fnmatch.fnmatch(name, pattern) for pattern in patterns):
                found[name] = (module, status_by_exit_code[exit_code])
    return found


def function_of(mutant: str) -> str:
    """`…upstreams.xǁMembershipǁadmit__mutmut_3` -> `Membership.admit`; `…x_slot_of__mutmut_1` -> `slot_of`."""
    mangled = mutant.partition("__mutmut_")[0].rpartition(".")[2]
    return mangled.removeprefix("x_") if mangled.startswith("x_") else ".".join(mangled.split("ǁ")[1:])


def number_of(mutant: str) -> tuple[str, int]:
    function, _, number = mutant.rpartition("__mutmut_")
    return function, int(number)


def shared_prefix(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def is_word(character: str) -> bool:
    return character.isalnum() or character == "_"


def one_line(diff: str, context: int = 24) -> str:
    """The change of a unified diff on one line: what differs, with a little of the line around it."""
    lines = diff.splitlines()[2:]
    old = " / ".join(line[1:].strip() for line in lines if line.startswith("-"))
    new = " / ".join(line[1:].strip() for line in lines if line.startswith("+"))
    start = shared_prefix(old, new)
    end = shared_prefix(old[start:][::-1], new[start:][::-1])
    while start and is_word(old[start - 1]):  # whole words, so `[nam -> (name) or Tru]e` reads `[name -> ...]`
        start -= 1
    while end and is_word(old[len(old) - end]):
        end -= 1
    head = old[max(0, start - context) : start]
    tail = old[len(old) - end :][:context]
    ellipsis = "…" if start > context else ""
    return f"{ellipsis}{head}[{old[start : len(old) - end]} -> {new[start : len(new) - end]}]{tail}"


def survivors(tree: Path, found: dict[str, tuple[str, str]]) -> list[Survivor]:
    alive = sorted((name for name, (_, status) in found.items() if status == "survived"), key=number_of)
    with contextlib.chdir(tree):
        changes = [one_line(get_diff_for_mutant(name, path=found[name][0])) for name in alive]
    return [Survivor(name, function_of(name), change) for name, change in zip(alive, changes, strict=True)]


def summarise(figures: Figures, tree: Path, found: dict[str, tuple[str, str]]) -> None:
    statuses = [status for _, status in found.values()]
    figures.mutants = len(statuses)
    figures.counts = {status: statuses.count(status) for status in STATUSES} | {
        status: statuses.count(status) for status in set(statuses) - set(STATUSES)
    }
    run = figures.mutants - sum(figures.counts[status] for status in NOT_RUN)
    figures.score = sum(figures.counts[status] for status in DETECTED) / run if run else None
    figures.survivors = survivors(tree, found)
    for name, (_, status) in sorted(found.items()):
        if status == "no tests":
            function = function_of(name)
            figures.no_tests_by_function[function] = figures.no_tests_by_function.get(function, 0) + 1


def measure(target: Target, source: Path, work: Path, sample: str) -> Figures:
    tree = work / target.name
    copy_tree(source, tree)
    modules, tests = existing(tree, target.modules), existing(tree, target.tests)
    functions = sorted({name for m in modules for name in called_functions((tree / m).read_text(), target.roots)})
    patterns = mutant_patterns(modules, functions, sample)
    figures = Figures(target.name, str(source), modules, functions, sample, tests)
    if not modules or not tests:
        figures.error = "no module or no test file of this target exists in the source tree"
        return figures
    write_config(tree, modules, tests)
    started = time.monotonic()
    figures.error = run_mutmut(tree, patterns, target.env, work / f"{target.name}.log")
    figures.wall_s = round(time.monotonic() - started, 1)
    if not figures.error:
        summarise(figures, tree, verdicts(tree, modules, patterns))
    return figures


# -- printing ----------------------------------------------------------------------------------------------------------


def report(figures: Figures) -> None:
    scope = f"functions {', '.join(figures.functions)}" if figures.functions else "whole files"
    print(f"\n== {figures.target}  (source {figures.source})")
    sampled = f"; only mutants numbered *{'/'.join(figures.sample)}" if figures.sample else ""
    print(f"   mutated: {', '.join(figures.modules)} ({scope}{sampled})")
    print(f"   tests:   {', '.join(figures.tests)}")
    if figures.error:
        print(f"   FAILED after {figures.wall_s:.0f} s: {figures.error}")
        return
    counts = "  ".join(f"{status} {count}" for status, count in figures.counts.items())
    score = "n/a" if figures.score is None else f"{100 * figures.score:.1f}%"
    print(f"   mutants {figures.mutants}  {counts}")
    print(f"   score {score}   wall {figures.wall_s:.0f} s")
    if figures.no_tests_by_function:
        untested = ", ".join(f"{function} ({count})" for function, count in figures.no_tests_by_function.items())
        print(f"   reached by no selected test: {untested}")
    print(f"   surviving mutants ({len(figures.survivors)}):")
    for survivor in figures.survivors:
        print(f"     {survivor.name}: {survivor.change}")


def summary(all_figures: list[Figures]) -> None:
    columns = ("killed", "survived", "timeout", "no tests")
    print(f"\n{SCORE}\n")
    print(f"{'target':<20} {'mutants':>8}" + "".join(f"{column:>9}" for column in columns) + "    other  score  wall s")
    for figures in all_figures:
        counts = [figures.counts.get(column, 0) for column in columns]
        score = "n/a" if figures.score is None else f"{100 * figures.score:.1f}%"
        print(
            f"{figures.target:<20} {figures.mutants:>8}"
            + "".join(f"{count:>9}" for count in counts)
            + f" {figures.mutants - sum(counts):>8} {score:>6} {figures.wall_s:>7.0f}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=[target.name for target in TARGETS], help="run this target only")
    parser.add_argument("--source", type=Path, default=ROOT, help="the tree to copy and test (default: this one)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument(
        "--sample",
        default="",
        metavar="DIGITS",
        help="test only the mutants whose number ends in one of DIGITS (5: about a tenth, 05: a fifth)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the copies and logs (`mutmut show NAME` there)")
    args = parser.parse_args()
    if not args.sample.isdecimal() and args.sample:
        parser.error("--sample takes digits, such as 5 or 05")
    source = args.source.resolve()
    work = Path(tempfile.mkdtemp(prefix="mutation-"))
    print(f"mutmut {importlib.metadata.version('mutmut')}, source {source}, work folder {work}")
    all_figures = []
    try:
        for target in TARGETS:
            if args.target in (None, target.name):
                all_figures.append(measure(target, source, work, args.sample))
                report(all_figures[-1])
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    summary(all_figures)
    if args.json:
        targets = [asdict(figures) for figures in all_figures]
        document = {"mutmut": importlib.metadata.version("mutmut"), "score": SCORE, "targets": targets}
        args.json.write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n")
    return 1 if any(figures.error for figures in all_figures) else 0


if __name__ == "__main__":
    sys.exit(main())
