"""libfaketime for the tests and benchmarks that run a process on a skewed wall clock: the library, and its settings.

Only the wall clock is skewed: a monotonic clock is per machine anyway, and a faked one hangs Python's timed waits,
which libfaketime does not intercept (`FAKETIME_DONT_FAKE_MONOTONIC`). Its "monotonic fix" of
`pthread_cond_timedwait`, for programs whose monotonic clock it fakes, is turned off too: with that clock left alone it
made the timed waits of Python's GIL end at once, and a process with two busy threads (a replica engine: its server and
its batching worker) spent half its CPU handing the GIL back and forth (`bench/faketime_engine.py`).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sysconfig

SETTINGS = {"FAKETIME_DONT_FAKE_MONOTONIC": "1", "FAKETIME_FORCE_MONOTONIC_FIX": "0"}


def skewed_env(library: str) -> dict[str, str]:
    """What a process needs in its environment, beside `FAKETIME` (its offset, e.g. "+5h"), to run skewed."""
    return {"LD_PRELOAD": library, **SETTINGS}


def find_libfaketime() -> tuple[str | None, list[str]]:
    """The libfaketime that `faketime` preloads (not the MT one, about twice as slow here), found rather than assumed
    for one architecture; and every place looked in, for the skip reason when there is none.

    Where it is: the package's own file list (Debian's `libfaketime`), else the faketime folder under the multiarch
    library folder of this platform (`x86_64-linux-gnu`, `aarch64-linux-gnu`, ...), else any such folder, else the
    folders other distributions and source installs use.
    """
    searched: list[str] = []
    if shutil.which("dpkg-query"):
        for package in ("libfaketime", "faketime"):
            searched.append(f"dpkg-query -L {package}")
            listed = subprocess.run(["dpkg-query", "-L", package], capture_output=True, text=True, timeout=60)
            for line in listed.stdout.splitlines():
                if line.endswith("/faketime/libfaketime.so.1") and os.path.isfile(line):
                    return line, searched
    triplets = [sysconfig.get_config_var("MULTIARCH"), f"{os.uname().machine}-linux-gnu"]
    patterns = [f"/usr/lib/{triplet}/faketime/libfaketime.so.1" for triplet in dict.fromkeys(filter(None, triplets))]
    patterns += [
        "/usr/lib/*/faketime/libfaketime.so.1",
        "/usr/lib64/faketime/libfaketime.so.1",
        "/usr/lib/faketime/libfaketime.so.1",
        "/usr/local/lib/faketime/libfaketime.so.1",
        "/usr/local/lib/*/faketime/libfaketime.so.1",
    ]
    for pattern in patterns:
        searched.append(pattern)
        found = sorted(glob.glob(pattern))
        if found:
            return found[0], searched
    return None, searched
