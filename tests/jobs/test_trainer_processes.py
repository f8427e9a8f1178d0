"""A trainer job of several processes (issue 13): its ranks agree on when to stop, and cancelling reaches them all.

Real processes throughout: two ranks joined over gloo the way torchrun starts them, and process trees shaped like a
local trainer job under `accelerate launch` (the ranks in sessions of their own, below the job's group). The
2-process demo end to end is in tests/test_e2e_demo.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from jobs.contract import layout
from jobs.contract.control import STOP, StopRequest
from jobs.ports import free_port
from jobs.processes import group_alive, terminate_group
from jobs.store import LocalStore
from tests.support.processes import job_tree, process_table
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]

# argv: store folder, step, then `store KEY REQUEST` (the main rank writes a stop request at that step) or `sigterm`
# (the rank sends itself SIGTERM at that step, as a cancelled job's agent signals every rank, each at its own moment).
RANK_STEPS = textwrap.dedent(
    """
    import json, os, signal, sys
    from transformers import TrainerControl, TrainerState
    from jobs.store import LocalStore
    from jobs.trainer import ranks
    from jobs.trainer.control import GracefulStop

    ranks.join_process_group(cuda=False)
    stop = GracefulStop(LocalStore(sys.argv[1]), "ranks", check_every=0)
    stop.install_signal_handler()
    state, control = TrainerState(), TrainerControl()
    for step in range(1, 9):
        state.global_step = step
        if step == int(sys.argv[2]):
            if sys.argv[3] == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            elif ranks.is_main_process():
                stop.store.put_bytes(sys.argv[4], sys.argv[5].encode())
        stop.on_step_end(None, state, control)
        if control.should_training_stop:
            break
    print(json.dumps({"rank": ranks.rank(), "step": step, "reason": stop.reason, "save": control.should_save}))
    ranks.leave_process_group()  # as the trainer job does on its way out
    """
)


def run_ranks(tmp_path: Path, arguments: dict[int, list[str]]) -> list[dict]:
    """Two ranks joined over gloo as torchrun starts them, each running RANK_STEPS with its arguments; what each
    printed, once both exited 0."""
    port = free_port()
    processes = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
        }
        command = [sys.executable, "-c", RANK_STEPS, str(tmp_path / f"rank-{rank}"), *arguments[rank]]
        processes.append(subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    results = []
    for process in processes:
        out, err = process.communicate(timeout=240)
        assert process.returncode == 0, err.decode()[-3000:]
        results.append(json.loads(out.decode().strip().splitlines()[-1]))
    return results


def test_every_rank_stops_at_the_step_the_main_process_decides(tmp_path):
    """Rank 1's store already asks to stop; rank 0's is asked at step 3. Both stop after step 3, with a checkpoint:
    only the main process looks, and its decision reaches every rank."""
    request = StopRequest(reason="stopped from the test").model_dump_json()
    key = layout.control_key("ranks", STOP)
    LocalStore(tmp_path / "rank-1").put_bytes(key, request.encode())
    results = run_ranks(tmp_path, {rank: ["3", "store", key, request] for rank in (0, 1)})
    assert results == [
        {"rank": 0, "step": 3, "reason": "stopped from the test", "save": True},
        {"rank": 1, "step": 3, "reason": "stopped from the test", "save": True},
    ]


def test_every_rank_survives_the_first_sigterm_and_stops_with_the_main_one(tmp_path):
    """A cancelled job's ranks are signalled one by one: rank 1 at step 2, rank 0 at step 3. Rank 1 neither dies
    (rank 0 would then hang in the next collective, with no checkpoint) nor stops alone: both stop after step 3,
    with a checkpoint, and exit 0."""
    results = run_ranks(tmp_path, {0: ["3", "sigterm"], 1: ["2", "sigterm"]})
    assert results == [
        {"rank": 0, "step": 3, "reason": "the job received SIGTERM", "save": True},
        {"rank": 1, "step": 3, "reason": "the job received SIGTERM", "save": True},
    ]


# A job shaped like a trainer under `accelerate launch`: the job's group leader (`sh`, as the local launcher starts
# it) runs an agent, which starts two ranks each in a session of its own (as torchrun does); rank 0 starts a child
# in its own group (the proxy). Each writes its pid; with IGNORE_TERM, rank 1 ignores SIGTERM.
TREE = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    folder, role = sys.argv[1], sys.argv[2]
    open(os.path.join(folder, role), "w").write(str(os.getpid()))
    if role == "rank-1" and os.environ.get("IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    children = {"agent": ["rank-0", "rank-1"], "rank-0": ["proxy"]}.get(role, [])
    for child in children:
        subprocess.Popen([sys.executable, __file__, folder, child], start_new_session=role == "agent")
    time.sleep(600)
    """
)


def start_tree(folder: Path, ignore_term: bool) -> tuple[subprocess.Popen, dict[str, int]]:
    script = folder / "tree.py"
    script.write_text(TREE)
    env = {**os.environ, **({"IGNORE_TERM": "1"} if ignore_term else {})}
    recorder = 'trap : TERM; "$@" & wait $!; wait $!'  # the launcher's group leader outlives a SIGTERM
    command = ["/bin/sh", "-c", recorder, "sh", sys.executable, str(script), str(folder), "agent"]
    leader = subprocess.Popen(command, env=env, start_new_session=True)
    threading.Thread(target=leader.wait, daemon=True).start()  # reap the leader, as the launcher does
    roles = ("agent", "rank-0", "rank-1", "proxy")
    wait_until(lambda: all((folder / role).exists() and (folder / role).read_text() for role in roles), 60)
    pids = {role: int((folder / role).read_text()) for role in roles}
    table = process_table()
    assert table[pids["rank-1"]].group != leader.pid and table[pids["proxy"]].group == pids["rank-0"]
    return leader, pids


def alive(pids: dict[str, int]) -> list[str]:
    table = process_table()
    return [role for role, pid in pids.items() if pid in table and not table[pid].exited]


@pytest.mark.parametrize("ignore_term", [False, True], ids=["ranks-stop-on-sigterm", "a-rank-ignores-sigterm"])
def test_cancelling_a_job_ends_its_ranks_in_sessions_of_their_own(tmp_path, ignore_term):
    leader, pids = start_tree(tmp_path, ignore_term)
    assert set(pids.values()) <= job_tree([leader.pid], process_table())
    killed = terminate_group(leader.pid, grace=3.0)
    assert killed == ignore_term  # SIGKILL only for what ignored SIGTERM through the grace
    wait_until(lambda: not alive(pids) and not group_alive(leader.pid), 10, what="every process of the job gone")
