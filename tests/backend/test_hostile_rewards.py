"""Hostile reward code, run as a shared Space runs it (strict confinement): each attempt is refused or stopped with a
clear message, and nothing leaks: no file written or read outside the scratch folder, no process, no connection,
no signal.

Each row goes through the whole sandbox (backend/sandbox/client.py: the runner's audit hook, then the OS layers of
jobs/confinement/confine.py). Routes the audit hook does not see (`_posixsubprocess.fork_exec`, reading a file) show
the OS layers at work; tests/test_security.py also runs code that skips the hook entirely.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from backend.sandbox.client import SandboxError, SandboxLimits, run_rewards
from jobs.contract import RewardSpec
from tests.support.net import accepted

ROWS = [{"prompt": "1+1?", "answer": "2"}] * 2
SECRET = "the-other-owners-secret-7f3a"
REPO = Path(__file__).resolve().parents[2]
REFUSED = "the reward sandbox refused it"

FORK_EXEC = """
import _posixsubprocess, os
def f(completions, **kw):
    pid = _posixsubprocess.fork_exec([b"/usr/bin/touch", b"{marker}"], [b"/usr/bin/touch"], True, (), None, None,
        -1, -1, -1, -1, -1, -1, *os.pipe(), True, False, 0, None, None, None, -1, None, True)
    return [float(pid)] * len(completions)
"""

# name -> (reward source, what the user is told: the error's fragment, or ("stopped", the SandboxError's fragment))
HOSTILE: dict[str, tuple[str, str | tuple[str, str]]] = {
    "read a secret file": (
        "def f(completions, **kw):\n    return [float(len(open({secret!r}).read()))] * len(completions)\n",
        REFUSED,
    ),
    "read another owner's sandbox folder": (
        "import os\ndef f(completions, **kw):\n    return [float(len(os.listdir({other!r})))] * len(completions)\n",
        REFUSED,
    ),
    "write outside its folder": (
        "def f(completions, **kw):\n    open({marker!r}, 'w').write('x')\n    return [1.0] * len(completions)\n",
        REFUSED,
    ),
    "open a socket": (
        "import socket\ndef f(completions, **kw):\n    socket.create_connection(('127.0.0.1', {port}), 2)\n"
        "    return [1.0] * len(completions)\n",
        "may not resolve host names",
    ),
    "open a socket through _socket": (
        "import _socket\ndef f(completions, **kw):\n    _socket.socket().connect(('127.0.0.1', {port}))\n"
        "    return [1.0] * len(completions)\n",
        REFUSED,  # the socket itself: seccomp, before the hook sees a connect
    ),
    "fetch a URL": (
        "import urllib.request\ndef f(completions, **kw):\n"
        "    urllib.request.urlopen('http://127.0.0.1:{port}/', timeout=2)\n    return [1.0] * len(completions)\n",
        "may not",
    ),
    "os.system": (
        "import os\ndef f(completions, **kw):\n    os.system('touch {marker}')\n    return [1.0] * len(completions)\n",
        "may not run shell commands",
    ),
    "subprocess": (
        "import subprocess\ndef f(completions, **kw):\n    subprocess.run(['touch', {marker!r}])\n"
        "    return [1.0] * len(completions)\n",
        "may not start processes",
    ),
    "_posixsubprocess.fork_exec": (FORK_EXEC, REFUSED),
    "os.fork": (
        "import os\ndef f(completions, **kw):\n    if os.fork() == 0:\n        open({marker!r}, 'w')\n"
        "        os._exit(0)\n    return [1.0] * len(completions)\n",
        "may not fork",
    ),
    "os.posix_spawn": (
        "import os\ndef f(completions, **kw):\n    os.posix_spawn('/usr/bin/touch', ['touch', {marker!r}], {{}})\n"
        "    return [1.0] * len(completions)\n",
        "may not start processes",
    ),
    "os.execv": (
        "import os\ndef f(completions, **kw):\n    os.execv('/usr/bin/touch', ['touch', {marker!r}])\n",
        "may not run programs",
    ),
    "multiprocessing": (
        "import multiprocessing, pathlib\ndef f(completions, **kw):\n"
        "    multiprocessing.Process(target=pathlib.Path({marker!r}).touch).start()\n"
        "    return [1.0] * len(completions)\n",
        "may not fork",
    ),
    "ctypes": (
        "import ctypes\ndef f(completions, **kw):\n    ctypes.CDLL(None).system(b'touch {marker}')\n"
        "    return [1.0] * len(completions)\n",
        "may not load C libraries",
    ),
    "signal the panel": (
        "import os\ndef f(completions, **kw):\n    os.kill(os.getppid(), 0)\n    return [1.0] * len(completions)\n",
        "may not signal processes",
    ),
    "exhaust memory": (
        "def f(completions, **kw):\n    hoard = bytearray(3 << 30)\n    return [1.0] * len(completions)\n",
        "needed more than 1024 MB of memory",
    ),
    "exhaust output": (
        "def f(completions, **kw):\n    print('x' * 5_000_000)\n    return [1.0] * len(completions)\n",
        "printed more than",
    ),
    "exhaust the CPU": (
        "def f(completions, **kw):\n    while True:\n        pass\n",
        ("stopped", "used more than 2s of CPU"),
    ),
    "hang": (
        "import time\ndef f(completions, **kw):\n    time.sleep(600)\n",
        ("stopped", "took longer than 2s"),
    ),
}


@pytest.fixture
def targets(tmp_path, monkeypatch):
    """A Space's strictness, and what a hostile reward reaches for: a marker path it must not create, another owner's
    secret and sandbox folder, and a listening socket it must not connect to."""
    monkeypatch.setenv("SPACE_ID", "someone/grpo-panel")
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    other = Path(tempfile.mkdtemp(prefix="reward-sandbox-"))  # beside the one the reward gets
    (other / "request.json").write_text(json.dumps({"rows": [SECRET]}))
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        listener.setblocking(False)
        yield {
            "marker": str(tmp_path / "escaped"),
            "secret": str(secret),
            "other": str(other),
            "port": listener.getsockname()[1],
            "listener": listener,
        }
    (other / "request.json").unlink()
    other.rmdir()


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_reward_is_refused_or_stopped_and_nothing_leaks(name, targets):
    source, told = HOSTILE[name]
    code = source.format(**{key: value for key, value in targets.items() if key != "listener"})
    reward = RewardSpec(kind="code", name="hostile", source=code, entry_point="f")
    limits = SandboxLimits(seconds=2)
    if isinstance(told, tuple):
        with pytest.raises(SandboxError, match=told[1]):
            run_rewards([reward], ROWS, ["2", "2"], limits)
    else:
        (trial,) = run_rewards([reward], ROWS, ["2", "2"], limits)
        assert trial.scores == [] and trial.error and told in trial.error, trial
        assert SECRET not in trial.error
    assert not Path(targets["marker"]).exists(), "reward code wrote outside its folder"
    assert not accepted(targets["listener"]), "reward code connected"


def test_a_shared_panel_runs_no_user_code_where_a_layer_is_missing(tmp_path):
    """Strict confinement refuses to go on without seccomp (here: no library for it), naming the layer; the runner
    then exits without running any reward and the panel says code rewards are off on this server."""
    from backend.sandbox.client import _explain_exit, confinement
    from jobs.confinement.confine import UNCONFINABLE_EXIT

    rules = confinement(SandboxLimits(), tmp_path, strict=True).to_json()
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        sys.modules["pyseccomp"] = None  # as on a system without libseccomp
        from jobs.confinement.confine import Confinement, ConfinementUnavailable, confine
        try:
            confine(Confinement.from_json({rules!r}))
        except ConfinementUnavailable as error:
            print(error)
            sys.exit({UNCONFINABLE_EXIT})
        """
    )
    done = subprocess.run([sys.executable, "-I", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == UNCONFINABLE_EXIT, done.stderr[-2000:]
    assert "could not apply seccomp" in done.stdout
    (tmp_path / "stdout").write_text(done.stdout)
    explained = _explain_exit(done.returncode, tmp_path / "stdout", SandboxLimits())
    assert explained.startswith("this server cannot confine reward code (could not apply seccomp")
    assert "use a built-in reward" in explained


def test_without_a_space_a_missing_layer_is_skipped_and_the_others_hold(tmp_path):
    """On one's own machine the same missing library skips seccomp only: Landlock still hides the files."""
    from backend.sandbox.client import confinement

    rules = confinement(SandboxLimits(), tmp_path, strict=False).to_json()
    script = textwrap.dedent(
        f"""
        import json, sys
        sys.path.insert(0, {str(REPO)!r})
        sys.modules["pyseccomp"] = None
        from jobs.confinement.confine import Confinement, confine
        applied = confine(Confinement.from_json({rules!r}))
        try:
            open({str(REPO / "README.md")!r}).read()
            readable = True
        except PermissionError:
            readable = False
        print(json.dumps({{"applied": applied, "readable": readable}}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-I", "-c", script], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"applied": ["limits", "landlock"], "readable": False}
    assert os.path.exists(REPO / "README.md")


def test_a_reward_burning_cpu_is_named_so_even_when_the_clock_stops_it_first():
    """Seen in CI under load: a reward spinning in a loop got a third of a core, so the wall-clock deadline stopped
    it before its CPU limit did, and it was reported as slow. Its CPU time, read before it is killed, says which."""
    from backend.sandbox.client import stopped_by_the_clock
    from jobs.confinement import cpu_seconds

    limits = SandboxLimits(seconds=2)
    assert "used more than 2s of CPU" in stopped_by_the_clock(2.3, limits, rows=2)
    assert "took longer than 2s on 2 rows" in stopped_by_the_clock(0.1, limits, rows=2)  # a reward that waits
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 1.2\n"
                                "while time.process_time() < end: pass\ntime.sleep(60)"])  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while cpu_seconds(spinner.pid) < 1.2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert 1.2 <= cpu_seconds(spinner.pid) < 5  # its own CPU time, not the wall clock's
    finally:
        spinner.kill()
        spinner.wait()
    assert cpu_seconds(spinner.pid) == 0.0  # gone: nothing to read
