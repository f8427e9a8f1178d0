"""Ports for servers that start later (replicas, engines, test servers) are picked where the kernel does not hand out
ports by itself, so an outgoing connection made meanwhile cannot take one, and no other picker hands one out twice
before its server is up (jobs/ports.py)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from jobs import ports
from jobs.ports import EPHEMERAL_RANGE, LOWEST, RESERVED_FOR_S, free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def own_reservations(tmp_path: Path, monkeypatch) -> Path:
    """A reservation file of this test's own, so that it neither takes nor sees the ports of the suite's servers."""
    path = tmp_path / "ports.json"
    monkeypatch.setattr(ports, "RESERVATIONS", path)
    return path


def bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.skipif(not EPHEMERAL_RANGE.exists(), reason="the kernel's port range is known on Linux only")
def test_ports_are_picked_at_random_below_the_kernels_own_range_and_are_free():
    floor = int(EPHEMERAL_RANGE.read_text().split()[0])
    picked = [free_port() for _ in range(40)]
    assert all(LOWEST <= port < floor for port in picked), (floor, picked)
    assert len(set(picked)) >= 35  # drawn at random, not one after another from a shared start
    assert all(bindable(port) for port in picked)


def kernel_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_port_that_is_taken_is_passed_over(monkeypatch):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        busy, other = listener.getsockname()[1], kernel_port()
        draws = iter([busy, other])
        monkeypatch.setattr(ports._RANDOM, "randrange", lambda low, high: next(draws))
        assert free_port() == other


def test_where_the_range_cannot_be_read_the_kernel_picks(monkeypatch, tmp_path: Path):
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", tmp_path / "no-such-file")
    monkeypatch.setattr(ports._RANDOM, "randrange", lambda low, high: pytest.fail("no port is drawn"))
    port = free_port()
    assert 0 < port < 65536 and bindable(port)


def test_a_port_picked_is_not_handed_out_again_until_its_reservation_lapses(monkeypatch):
    free = kernel_port()
    monkeypatch.setattr(ports, "_ephemeral_floor", lambda: LOWEST + 1_000)
    monkeypatch.setattr(ports._RANDOM, "randrange", lambda low, high: free)
    assert free_port() == free
    # still free, but promised to whoever picked it: every draw of it is passed over, and the kernel picks instead
    again = free_port()
    assert again != free and bindable(again)
    later = ports._since_boot() + RESERVED_FOR_S + 1
    monkeypatch.setattr(ports, "_since_boot", lambda: later)
    assert free_port() == free


def test_pickers_in_separate_processes_never_hand_out_the_same_port(tmp_path: Path, own_reservations: Path):
    """Four processes draw 60 ports each from 1,000 without binding any (as a replica does before its engine is up).
    Drawn independently, some 29 pairs would coincide on average."""
    narrow = tmp_path / "ip_local_port_range"
    narrow.write_text(f"{LOWEST + 1_000} 60999\n")
    pick = (
        "import sys; from pathlib import Path; from jobs import ports; "
        "ports.EPHEMERAL_RANGE, ports.RESERVATIONS = Path(sys.argv[1]), Path(sys.argv[2]); "
        "print(*(ports.free_port() for _ in range(60)))"
    )
    pickers = [
        subprocess.Popen(
            [sys.executable, "-c", pick, str(narrow), str(own_reservations)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    picked = [int(port) for picker in pickers for port in picker.communicate(timeout=60)[0].split()]
    assert [picker.returncode for picker in pickers] == [0] * 4
    assert len(picked) == 240 and len(set(picked)) == 240
    assert all(LOWEST <= port < LOWEST + 1_000 for port in picked)


def test_a_reservation_file_cut_short_is_started_afresh(own_reservations: Path):
    own_reservations.write_text('{"2')
    port = free_port()
    assert bindable(port) and str(port) in own_reservations.read_text()
