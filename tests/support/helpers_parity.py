"""Module-level targets for the multiprocessing-parity tests (children import this module by reference,
so it stays cheap to import: no pytest)."""
from __future__ import annotations

import logging
import multiprocessing
import threading
import time

import roving


def set_event_from_a_thread_and_return(evt, delay):
    """multiprocessing's test_wait_for_threads: a non-daemonic thread sets the event after the target
    returned; a daemonic one would clear it much later (the child must not wait for that one)."""
    def late_set():
        time.sleep(delay)
        evt.set()

    def never_awaited():
        time.sleep(60)
        evt.clear()

    threading.Thread(target=late_set).start()
    threading.Thread(target=never_awaited, daemon=True).start()


class Dummy:
    """A target object to hold by weak reference (multiprocessing's DummyCallable)."""

    def __call__(self, q, c):
        assert isinstance(c, Dummy)
        q.put(5)


def put_five(q, big):
    q.put(5 if len(big) else 0)


def report_stdlib_identity(q):
    """What the standard library's multiprocessing (and logging's processName) says about this process."""
    cur, parent = multiprocessing.current_process(), multiprocessing.parent_process()
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    q.put({"name": cur.name, "pid": cur.pid, "ident": cur.ident, "daemon": cur.daemon,
           "roving_name": roving.current_process().name, "roving_pid": roving.current_process().pid,
           "parent_name": parent.name if parent is not None else None,
           "parent_pid": parent.pid if parent is not None else None,
           "parent_alive": parent.is_alive() if parent is not None else None,
           "log_process_name": record.processName,
           "same_authkey": cur.authkey == roving.current_process().authkey})


def rename_and_report(q, new_name):
    roving.current_process().name = new_name
    q.put(multiprocessing.current_process().name)
