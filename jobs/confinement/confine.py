"""Confinement of untrusted code, applied by the sandboxed process to itself (the panel's reward sandbox runner,
backend/sandbox/runner.py).

The runner applies it after exec, in its one thread, before any user code exists: nothing is done in a child forked
from the threaded panel, where loading a library could deadlock on a lock another thread held at the fork. Layers:

1. Its own user and network namespace where the kernel allows one: no network device but a loopback of its own, and
   no abstract socket of the panel's namespace. Entered first, while no library has started a thread (the kernel
   refuses a new user namespace to a threaded process).
2. Resource limits: CPU time, address space, file size (what it prints), no core dumps.
3. Landlock: read Python and the job code, write the scratch folder; nothing else exists for it
   (jobs/confinement/landlock.py).
4. A seccomp filter: no new process (fork, vfork, clone without CLONE_THREAD; clone3 answers ENOSYS so libc falls
   back to clone, whose flags the filter can read), no program executed, no socket, no signal to another process,
   no namespace, mount, ptrace, io_uring (its operations would bypass the filter), bpf or keyring call.

Python's audit hook (in the runner) stays the first line, for its clear messages; these layers hold past it: against
ctypes, `_posixsubprocess.fork_exec` and whatever else reaches the kernel without an audited Python call.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
from dataclasses import asdict, dataclass
from typing import Any

from jobs.confinement import landlock

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
CLONE_THREAD = 0x00010000
UNCONFINABLE_EXIT = 78  # the runner's exit status when strict confinement could not be applied (sysexits' EX_CONFIG)

_REFUSED = (  # refused with EPERM whatever their arguments
    "fork",
    "vfork",
    "execve",
    "execveat",
    "socket",
    "tkill",
    "pidfd_open",
    "pidfd_send_signal",
    "pidfd_getfd",
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "move_mount",
    "open_tree",
    "fsopen",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "keyctl",
    "add_key",
    "request_key",
)


class ConfinementUnavailable(OSError):
    """A layer a shared panel requires could not be applied on this kernel."""


@dataclass(frozen=True)
class Confinement:
    """What the sandboxed process may use: CPU seconds, bytes of address space and of output, and the paths Landlock
    lets it reach (path -> landlock access bits). `strict` (a shared panel) makes a missing Landlock or seccomp an
    error instead of a layer skipped."""

    seconds: float
    memory_bytes: int
    output_bytes: int
    paths: dict[str, int]
    strict: bool

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Confinement:
        return cls(**data)


def enter_namespaces() -> bool:
    """Move into a new user and network namespace; False where the kernel does not allow it (the other layers hold).

    No uid is mapped into the new namespace: the process's capabilities there then apply to no file at all."""
    libc = ctypes.CDLL(None, use_errno=True)
    status: int = libc.unshare(CLONE_NEWUSER | CLONE_NEWNET)
    return status == 0


def confine(confinement: Confinement) -> list[str]:
    """Apply the limits, Landlock and the seccomp filter to this process, for good; returns the layers applied.

    Raises ConfinementUnavailable in strict mode when Landlock or seccomp cannot be applied."""
    cpu = int(confinement.seconds) + 1
    for limit, value in (
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_AS, (confinement.memory_bytes,) * 2),
        (resource.RLIMIT_FSIZE, (confinement.output_bytes,) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        resource.setrlimit(limit, value)
    applied, missing = ["limits"], []
    try:
        system_calls = _system_call_filter()  # built before Landlock hides the library's files, loaded after
    except OSError as error:
        system_calls = None
        missing.append(f"seccomp ({error})")
    try:
        landlock.confine(confinement.paths)
        applied.append("landlock")
    except OSError as error:
        missing.append(f"Landlock ({error})")
    if system_calls is not None:
        try:
            system_calls.load()
            applied.append("seccomp")
        except OSError as error:
            missing.append(f"seccomp ({error})")
    if confinement.strict and missing:
        raise ConfinementUnavailable("could not apply " + " and ".join(missing))
    return applied


def _system_call_filter() -> Any:  # a pyseccomp.SyscallFilter, imported late: the panel never loads it
    try:
        import pyseccomp as seccomp
    except Exception as error:  # pyseccomp fails in several ways where libseccomp is missing
        raise OSError(f"no seccomp library ({error})") from None
    own = os.getpid()
    refuse = seccomp.ERRNO(errno.EPERM)
    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    for call in _REFUSED:
        try:
            rules.add_rule(refuse, call)
        except (ValueError, RuntimeError, OSError):  # a call this architecture does not have (fork on aarch64)
            continue
    rules.add_rule(refuse, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_THREAD, 0))  # a process, not a thread
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")  # its flags sit in memory the filter cannot read
    for call in ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo"):  # signals to this process only
        rules.add_rule(refuse, call, seccomp.Arg(0, seccomp.NE, own))
    return rules
