"""Ports for servers that start later (replicas, engines, test servers) are picked where the kernel does not hand out
ports by itself, so an outgoing connection made meanwhile cannot take one (jobs/ports.py)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from jobs import ports
from jobs.ports import EPHEMERAL_RANGE, LOWEST, free_port


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


def test_a_port_that_is_taken_is_passed_over(monkeypatch):
    with socket.socket() as listener:
        busy = free_port()
        listener.bind(("127.0.0.1", busy))
        listener.listen()
        other = free_port()
        draws = iter([busy, other])
        monkeypatch.setattr(ports._RANDOM, "randrange", lambda low, high: next(draws))
        assert free_port() == other


def test_where_the_range_cannot_be_read_the_kernel_picks(monkeypatch, tmp_path: Path):
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", tmp_path / "no-such-file")
    monkeypatch.setattr(ports._RANDOM, "randrange", lambda low, high: pytest.fail("no port is drawn"))
    port = free_port()
    assert 0 < port < 65536 and bindable(port)
