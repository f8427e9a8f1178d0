"""Where the test suite's time goes: per test file and per test, from the JUnit XML files of two runs side by side.

    .venv/bin/python -m pytest --junitxml=after.xml              # (scripts/test passes its arguments to pytest)
    .venv/bin/python bench/suite_times.py before.xml after.xml [--slowest 20]

Each file's figure is the sum of its tests' times (set-up, call and teardown, as JUnit records them). Under parallel
workers those sums add up to more than the wall time, and every test runs slower beside the others: compare the
files' shares with each other, and the suite's wall time with the wall time pytest printed.
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path


def test_times(junit: Path) -> dict[str, float]:
    """{test id: seconds} of one run; xdist's `@group` suffix is dropped so that runs with and without it match."""
    times: dict[str, float] = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        name = case.get("name", "")
        group = name.rfind("@")
        if group > name.rfind("]"):
            name = name[:group]
        times[f"{case.get('classname', '')}::{name}"] = float(case.get("time", 0))
    return times


def per_file(times: dict[str, float]) -> dict[str, float]:
    files: dict[str, float] = defaultdict(float)
    for test, seconds in times.items():
        files[test.split("::")[0]] += seconds
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--slowest", type=int, default=20, help="how many of the after run's slowest tests to list")
    args = parser.parse_args()
    before, after = test_times(args.before), test_times(args.after)
    files_before, files_after = per_file(before), per_file(after)
    print("| test file | tests | before s | after s |")
    print("|---|---:|---:|---:|")
    for name in sorted(files_before.keys() | files_after.keys(), key=lambda f: -files_before.get(f, 0.0)):
        count = sum(1 for test in after if test.split("::")[0] == name)
        print(f"| {name} | {count} | {files_before.get(name, 0.0):.0f} | {files_after.get(name, 0.0):.0f} |")
    print(f"| **all** | {len(after)} | {sum(before.values()):.0f} | {sum(after.values()):.0f} |")
    print(f"\n{args.slowest} slowest tests of {args.after.name}:\n")
    print("| s | test |")
    print("|---:|---|")
    for test, seconds in sorted(after.items(), key=lambda item: -item[1])[: args.slowest]:
        print(f"| {seconds:.0f} | {test} |")


if __name__ == "__main__":
    main()
