"""The `python` built-in: one tool that runs a Python program and returns what it printed, for code and data tasks.

The program is the model's, so it runs as reward code does in the panel: in a fresh interpreter of its own that
confines itself before the program exists (jobs/confinement: no network, no process, no file outside its scratch
folder, limits on CPU, memory and output), with a wall-clock deadline here. Whatever happens, the model gets text.
"""

from __future__ import annotations

import json
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from jobs.confinement import landlock, python_paths, run_confined
from jobs.confinement.confine import Confinement

if TYPE_CHECKING:  # what the runner reads from request.json and writes to result.json
    from jobs.confinement.execute import Request, Result

RUNNER = Path(__file__).resolve().parent.parent / "confinement" / "execute.py"
SECONDS = 5.0  # CPU time, and the wall-clock deadline after start-up
MEMORY_BYTES = 512 << 20
MAX_OUTPUT_CHARS = 2000  # what the model is shown of the output: it goes into its next prompt


def run_python(code: str) -> str:
    """Run a Python program and return what it printed (its error, if it raised).

    Args:
        code: the program; print what you want to see, e.g. print(sum(range(10)))
    """
    with tempfile.TemporaryDirectory(prefix="python-tool-") as folder:
        scratch = Path(folder)
        paths = python_paths(scratch) | {str(RUNNER): landlock.READ_FILE}
        confinement = Confinement(SECONDS, MEMORY_BYTES, MAX_OUTPUT_CHARS * 8, paths, strict=False)
        request: Request = {"code": code, "max_chars": MAX_OUTPUT_CHARS, "confinement": confinement.to_json()}
        code_exit, burned = run_confined(RUNNER, scratch, request, SECONDS, subprocess.DEVNULL)
        if code_exit is None:
            if burned >= SECONDS:
                return _died(-signal.SIGXCPU)
            return f"error: the program ran longer than {SECONDS:.0f} s and was stopped"
        result_path = scratch / "result.json"
        if not result_path.exists():
            return _died(code_exit)
        result: Result = json.loads(result_path.read_text())
    said = [str(result.get("output") or "").rstrip("\n")] + [f"error: {result['error']}"] * bool(result.get("error"))
    return "\n".join(part for part in said if part) or "(the program printed nothing)"


def _died(code: int) -> str:
    if code in (-signal.SIGXCPU, -signal.SIGKILL):
        return f"error: the program used more than {SECONDS:.0f} s of CPU and was stopped"
    if code == -signal.SIGXFSZ:
        return "error: the program printed too much and was stopped"
    return f"error: the program ended without a result (exit code {code}); it may have run out of memory"


TOOLS = [run_python]
