"""Runs a Python program confined, and writes what it printed; not imported by the jobs, but executed:

    python -I execute.py <project root> <request.json> <result.json>

The runner confines itself (confine.py) in its one thread, after exec and before the program exists, then installs
the audit hook (audit.py) and runs the program with its output captured, up to the request's byte limit. What the
program raises is part of what it printed, as a Python traceback's last line would be.
"""

import io
import json
import os
import sys
from contextlib import redirect_stderr, redirect_stdout

# mypy reads TYPE_CHECKING as true; at run time the runner imports nothing more than the above before it confines
# itself, so the request's and result's shapes are types for the checker only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, TypedDict

    class Request(TypedDict):
        """What jobs/environments/python.py writes to request.json."""

        code: str
        max_chars: int
        confinement: dict[str, Any]  # Confinement.to_json()

    class Result(TypedDict, total=False):
        """result.json: what the program printed and how it ended, or why it could not run."""

        output: str
        error: str | None


def main(root: str, request_path: str, result_path: str) -> None:
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # nothing the launcher might have left open
    os.environ.clear()
    sys.path.insert(0, root)
    with open(request_path) as handle:
        request: Request = json.load(handle)
    from jobs.confinement import audit
    from jobs.confinement.confine import Confinement, ConfinementUnavailable, confine, enter_namespaces

    enter_namespaces()  # first: the kernel refuses a new user namespace once a library has started a thread
    try:
        confine(Confinement.from_json(request["confinement"]))
    except ConfinementUnavailable as error:
        _write(result_path, {"error": f"the Python tool cannot be confined on this machine ({error})"})
        return
    audit.install("code run by the Python tool")
    captured = io.StringIO()
    ending = None
    try:
        with redirect_stdout(captured), redirect_stderr(captured):
            exec(compile(request["code"], "<code>", "exec"), {"__name__": "__main__"})
    except BaseException as raised:  # SystemExit too: the program's end, said as such
        ending = f"{type(raised).__name__}: {raised}"
    _write(result_path, {"output": captured.getvalue()[: request["max_chars"]], "error": ending})


def _write(path: str, result: "Result") -> None:
    with open(path, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main(*sys.argv[1:4])
