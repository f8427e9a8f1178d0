"""Confine the current process (and what it executes) to a few paths with Linux Landlock (kernel 5.13+, unprivileged).

Used in the reward sandbox's child before it executes Python: the interpreter, its libraries and the job code can
be read, the scratch folder written, and nothing else is reachable: not the panel's data folder (vault key,
database), not /proc/<panel>/environ, no program can be executed (so libc's system() through ctypes runs nothing),
and from Landlock ABI 4 on, no TCP connection can be made at all.
"""

from __future__ import annotations

import ctypes
import os

_CREATE, _ADD_RULE, _RESTRICT = 444, 445, 446  # the same numbers on x86_64 and aarch64
_PR_SET_NO_NEW_PRIVS = 38
_RULE_PATH_BENEATH = 1
_VERSION = 1  # landlock_create_ruleset flag: return the ABI version

EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1, 2, 4, 8
REMOVE_FILE, MAKE_REG, TRUNCATE = 32, 256, 16384
_FS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1, 5: (1 << 16) - 1}
_NET_TCP = 1 | 2  # bind, connect
_SCOPES = 1 | 2  # abstract unix sockets, signals


class _Ruleset(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def abi() -> int:
    """The kernel's Landlock ABI version, 0 if Landlock is not available."""
    libc = ctypes.CDLL(None, use_errno=True)
    version: int = libc.syscall(_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(_VERSION))
    return max(version, 0)


def confine(rules: dict[str, int]) -> int:
    """Allow only `rules` (path -> access bits, applied beneath a folder); returns the ABI used. Irreversible."""
    version = abi()
    if version < 1:
        raise OSError("Landlock is not available on this kernel")
    libc = ctypes.CDLL(None, use_errno=True)
    fs = _FS_BY_ABI.get(version, _FS_BY_ABI[5])
    attr = _Ruleset(fs, _NET_TCP if version >= 4 else 0, _SCOPES if version >= 6 else 0)
    size = 8 if version < 4 else 16 if version < 6 else 24
    ruleset = libc.syscall(_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        for path, access in rules.items():
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                allowed = access if os.path.isdir(path) else access & (EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE)
                beneath = _PathBeneath(allowed & fs, fd)
                if libc.syscall(_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(beneath), 0) != 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule failed for {path}")
            finally:
                os.close(fd)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS failed")
        if libc.syscall(_RESTRICT, ruleset, 0) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(ruleset)
    return version
