"""The `python` built-in: one tool that runs a Python program and returns what it printed, for code and data tasks.

The program is the model's, so it runs as reward code does in the panel: in a fresh interpreter of its own that
confines itself before the program exists (jobs/confinement: no network, no process, no file outside its scratch
folder, limits on CPU, memory and output), with a wall-clock deadline here. Whatever happens, the model gets text.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from jobs.confinement import PROJECT_ROOT, cpu_seconds, landlock, python_paths, wait_confined
from jobs.confinement.confine import Confinement

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
        request = {"code": code, "max_chars": MAX_OUTPUT_CHARS, "confinement": confinement.to_json()}
        (scratch / "request.json").write_text(json.dumps(request))
        process = subprocess.Popen(
            [sys.executable, "-I", str(RUNNER), str(PROJECT_ROOT), "request.json", "result.json"],
            cwd=scratch,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(scratch)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        code_exit = wait_confined(process, SECONDS)
        if code_exit is None:
            burned = cpu_seconds(process.pid)
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return (
                _died(-signal.SIGXCPU)
                if burned >= SECONDS
                else f"error: the program ran longer than {SECONDS:.0f} s and was stopped"
            )
        result_path = scratch / "result.json"
        if not result_path.exists():
            return _died(code_exit)
        result = json.loads(result_path.read_text())
    said = [str(result.get("output") or "").rstrip("\n")] + [f"error: {result['error']}"] * bool(result.get("error"))
    return "\n".join(part for part in said if part) or "(the program printed nothing)"


def _died(code: int) -> str:
    if code in (-signal.SIGXCPU, -signal.SIGKILL):
        return f"error: the program used more than {SECONDS:.0f} s of CPU and was stopped"
    if code == -signal.SIGXFSZ:
        return "error: the program printed too much and was stopped"
    return f"error: the program ended without a result (exit code {code}); it may have run out of memory"


TOOLS = [run_python]
