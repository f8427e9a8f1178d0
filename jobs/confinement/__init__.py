"""What untrusted code runs under, wherever it runs: the panel's reward sandbox (backend/sandbox/client.py) and, in the
trainer, the tools of an agent's environment. `confine` applies namespaces, resource limits, Landlock (`landlock`) and
a seccomp filter to the calling process; the jobs import nothing from the panel, so the one copy lives here."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from jobs.confinement import landlock

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def python_paths(scratch: Path) -> dict[str, int]:
    """What a confined Python interpreter may touch (path -> Landlock access): run itself and its libraries, read the
    standard library, the installed packages and the jobs' code, and read and write its scratch folder."""
    read = landlock.READ_FILE | landlock.READ_DIR
    return {
        os.path.realpath(sys.executable): landlock.EXECUTE | landlock.READ_FILE,
        os.path.realpath("/lib64/ld-linux-x86-64.so.2"): landlock.EXECUTE | landlock.READ_FILE,
        os.path.realpath("/lib/ld-linux-aarch64.so.1"): landlock.EXECUTE | landlock.READ_FILE,
        "/usr/lib": read,
        "/usr/lib64": read,
        "/etc/ld.so.cache": landlock.READ_FILE,
        "/dev/null": landlock.READ_FILE | landlock.WRITE_FILE,
        sys.base_prefix: read,
        sys.prefix: read,
        str(PROJECT_ROOT): landlock.READ_DIR,  # names only: imports list the folder; files below stay unreadable
        str(PROJECT_ROOT / "jobs"): read,
        str(scratch): read | landlock.WRITE_FILE | landlock.MAKE_REG | landlock.TRUNCATE | landlock.REMOVE_FILE,
    }


START_UP_S = 5.0  # a confined interpreter's start and imports, beside the code's own time
WALL_LIMIT_FACTOR = 4  # code still computing past its wall-clock deadline is given this many times its CPU limit


def wait_confined(process: subprocess.Popen[bytes], seconds: float) -> int | None:
    """The exit code of confined code given `seconds` of CPU, or None if it is to be stopped by the clock.

    The wall-clock deadline is its limit plus start-up; past it, code still computing (scheduler state R) is waited
    for while its CPU limit can stop it, up to `WALL_LIMIT_FACTOR` times that limit. On a busy machine computing code
    gets only a share of a core: under a load of 13 on two cores a spinning reward had used under 2 s of CPU at its
    7 s deadline, and was called slow rather than CPU-bound. Code waiting on anything else is stopped at the
    deadline."""
    try:
        return process.wait(timeout=seconds + START_UP_S)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + seconds * (WALL_LIMIT_FACTOR - 1)
    while _state(process.pid) == "R" and time.monotonic() < deadline:
        try:
            return process.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            continue
    return process.poll()


def cpu_seconds(pid: int) -> float:
    """CPU time a live process has used so far (user + system), 0 if it cannot be read: which limit stopped confined
    code depends on the load (RLIMIT_CPU counts its own CPU, the wall clock everything else's too)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _state(pid: int) -> str:
    """A process's scheduler state (R: running or runnable, S: sleeping, ...), "" if it cannot be read."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def run_confined(
    runner: Path, scratch: Path, request: Mapping[str, object], seconds: float, output: IO[bytes] | int
) -> tuple[int | None, float]:
    """Run `runner` on `request` in a fresh interpreter that confines itself, in `scratch`; its exit code (None when
    the clock stopped it, then killed with what it started) and the CPU seconds it had used by then.

    The runner gets the project root, `request.json` and `result.json` (in `scratch`, its working folder) and an
    empty environment. No preexec_fn: the child confines itself after exec (a fork of a threaded process must not
    run Python)."""
    (scratch / "request.json").write_text(json.dumps(request, default=str))
    process = subprocess.Popen(
        [sys.executable, "-I", str(runner), str(PROJECT_ROOT), "request.json", "result.json"],
        cwd=scratch,
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(scratch)},
        stdout=output,
        stderr=subprocess.STDOUT if output != subprocess.DEVNULL else subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    code = wait_confined(process, seconds)
    if code is not None:
        return code, 0.0
    burned = cpu_seconds(process.pid)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    return None, burned
