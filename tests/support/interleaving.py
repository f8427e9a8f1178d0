"""Deterministic interleavings of threads at every SQL statement and store call, chosen by the caller.

Each worker runs in a thread of its own, but only one runs at a time: a worker stops before every SQL statement it
sends, before every commit and before every store call (a `PausingStore`), and waits there until the scheduler picks
it. The caller decides which worker goes next, and whether it dies there, so an interleaving is a sequence of
choices: drawn from Hypothesis, every one is reproducible and a failing one shrinks to a short schedule.

A kill raises `Killed` (a BaseException, so no `except Exception` in the product catches it) at the point where the
worker stopped: it unwinds like a process death, and its open transaction is rolled back when its session closes.

SQLite blocks a writer while another connection holds the write lock. A worker stopped inside a write transaction
never gets on while another waits for that lock, so the scheduler never picks a worker whose next statement writes
while another worker's connection is in a transaction (it would wait for a lock nobody is running to release).
"""

from __future__ import annotations

import sqlite3
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine

from jobs.store import ObjectStore
from jobs.store.base import ObjectInfo

_WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE", "BEGIN IMMEDIATE", "BEGIN EXCLUSIVE")
STUCK_AFTER_S = 30.0  # a worker that runs this long without reaching a point is blocked: the model above is wrong


class Killed(BaseException):
    """The worker dies at this point, as its process would on SIGKILL."""


class Aborted(BaseException):
    """The schedule itself failed: every worker unwinds at its next point and ends."""


@dataclass
class Point:
    kind: str  # "sql", "commit", "store", "start"
    detail: str
    writes: bool = False


@dataclass
class Worker:
    name: str
    target: Callable[[], None]
    thread: threading.Thread | None = None
    at: Point | None = None  # where it waits to be picked; None while it runs
    go: str | None = None  # the scheduler's answer: "run" or "kill"
    done: bool = False
    error: BaseException | None = None
    connections: list[Any] = field(default_factory=list)  # the DB-API connections it has used


class Scheduler:
    """Runs workers one at a time, at points chosen by `choose(runnable names) -> (name, kill)`."""

    def __init__(self) -> None:
        self.workers: dict[str, Worker] = {}
        self._by_thread: dict[int, Worker] = {}
        self._condition = threading.Condition()
        self.steps = 0
        self.kills = 0
        self._aborted = False

    # --- setting up ----------------------------------------------------------------------------------------------

    def add(self, name: str, target: Callable[[], None]) -> None:
        self.workers[name] = Worker(name, target)

    def __enter__(self) -> Scheduler:
        event.listen(Engine, "before_cursor_execute", self._before_execute)
        event.listen(Engine, "commit", self._before_commit)
        return self

    def __exit__(self, *exc_info: object) -> None:
        event.remove(Engine, "before_cursor_execute", self._before_execute)
        event.remove(Engine, "commit", self._before_commit)

    # --- in the workers' threads ---------------------------------------------------------------------------------

    def point(self, kind: str, detail: str = "", writes: bool = False, connection: Any = None) -> None:
        """Stop here until picked; raise Killed if the scheduler decided this worker dies here."""
        worker = self._by_thread.get(threading.get_ident())
        if worker is None:
            return  # the test's own thread, or a thread nobody schedules
        with self._condition:
            if connection is not None and all(known is not connection for known in worker.connections):
                worker.connections.append(connection)
            worker.at = Point(kind, detail, writes)
            self._condition.notify_all()
            self._condition.wait_for(lambda: worker.go is not None or self._aborted)
            go, worker.go, worker.at = worker.go, None, None
        if self._aborted:
            raise Aborted(worker.name)
        if go == "kill":
            raise Killed(f"{worker.name} killed before {kind} {detail[:60]}")

    def _before_execute(self, conn, cursor, statement, parameters, context, executemany) -> None:
        text = statement.lstrip().upper()
        self.point("sql", statement, text.startswith(_WRITES), conn.connection.dbapi_connection)

    def _before_commit(self, conn) -> None:
        self.point("commit", "", False, conn.connection.dbapi_connection)

    def _run_worker(self, worker: Worker) -> None:
        self._by_thread[threading.get_ident()] = worker
        try:
            try:
                self.point("start")
            except Killed:
                return  # it died before doing anything
            worker.target()
        except BaseException as error:  # reported by run(); a Killed that escaped the target too
            worker.error = error
        finally:
            with self._condition:
                del self._by_thread[threading.get_ident()]  # thread ids are reused: a later thread is nobody's
                worker.done = True
                self._condition.notify_all()

    # --- in the test's thread ------------------------------------------------------------------------------------

    def run(self, choose: Callable[[list[str]], tuple[str, bool]]) -> None:
        """Run every worker to its end, one step at a time; raise the first error a worker ended with.

        If the schedule itself fails (`choose` raised, a worker got stuck), every worker is unwound before the error
        goes on, so no thread is left waiting for a turn that will never come.
        """
        for worker in self.workers.values():
            worker.thread = threading.Thread(target=self._run_worker, args=(worker,), name=worker.name, daemon=True)
            worker.thread.start()
        try:
            self._schedule(choose)
        except BaseException:
            with self._condition:
                self._aborted = True
                self._condition.notify_all()
            raise
        finally:
            for worker in self.workers.values():
                worker.thread.join(timeout=10)
        for worker in self.workers.values():
            if worker.error is not None:
                raise worker.error

    def _schedule(self, choose: Callable[[list[str]], tuple[str, bool]]) -> None:
        while True:
            with self._condition:
                settled = self._condition.wait_for(self._all_stopped, STUCK_AFTER_S)
                if not settled:
                    running = [w for w in self.workers.values() if not w.done and w.at is None]
                    stacks = "".join(_stack(w) for w in running)
                    raise AssertionError(f"{[w.name for w in running]} never reached their next point:\n{stacks}")
                runnable = [w.name for w in self.workers.values() if not w.done and not self._blocked(w)]
                if not runnable:
                    if all(w.done for w in self.workers.values()):
                        return
                    raise AssertionError("every waiting worker is blocked: the lock model is wrong")
            name, kill = choose(runnable)
            with self._condition:
                self.steps += 1
                self.kills += kill
                self.workers[name].go = "kill" if kill else "run"
                self._condition.notify_all()

    def _all_stopped(self) -> bool:
        return all(w.done or (w.at is not None and w.go is None) for w in self.workers.values())

    def _blocked(self, worker: Worker) -> bool:
        """Would its next statement wait for a write lock another (stopped) worker holds?"""
        if not worker.at.writes:
            return False
        return any(
            _in_transaction(connection)
            for other in self.workers.values()
            if other is not worker and not other.done
            for connection in other.connections
        )


def _stack(worker: Worker) -> str:
    frame = sys._current_frames().get(worker.thread.ident) if worker.thread else None
    return f"--- {worker.name}\n" + "".join(traceback.format_stack(frame)) if frame else ""


def _in_transaction(connection: Any) -> bool:
    try:
        return connection.in_transaction
    except sqlite3.ProgrammingError:  # closed: a killed worker's engine was disposed
        return False


class PausingStore(ObjectStore):
    """A store whose every call is a scheduling point (the store is where other processes' writes show up)."""

    def __init__(self, inner: ObjectStore, scheduler: Scheduler):
        self.inner, self.scheduler = inner, scheduler

    def describe(self) -> str:
        return self.inner.describe()

    def put_bytes(self, key: str, data: bytes) -> None:
        self.scheduler.point("store", f"put {key}")
        self.inner.put_bytes(key, data)

    def get_bytes(self, key: str) -> bytes:
        self.scheduler.point("store", f"get {key}")
        return self.inner.get_bytes(key)

    def put_file(self, key: str, path) -> None:
        self.scheduler.point("store", f"put {key}")
        self.inner.put_file(key, path)

    def get_file(self, key: str, path) -> None:
        self.scheduler.point("store", f"get {key}")
        self.inner.get_file(key, path)

    def list(self, prefix: str = "", start_after: str | None = None, limit: int | None = None) -> Iterator[ObjectInfo]:
        self.scheduler.point("store", f"list {prefix} after {start_after}")
        return iter(list(self.inner.list(prefix, start_after=start_after, limit=limit)))

    def exists(self, key: str) -> bool:
        self.scheduler.point("store", f"exists {key}")
        return self.inner.exists(key)

    def delete(self, key: str) -> None:
        self.scheduler.point("store", f"delete {key}")
        self.inner.delete(key)
