"""The one selector thread under the sentinel watcher and the output pump: handlers run in its thread,
a forgotten file's ``then`` runs there too, and a handler that raises loses its own file only."""
from __future__ import annotations

import os
import queue
import threading

from roving.system.selector_thread import SelectorThread

T = 30


def test_handlers_run_in_the_watching_thread_and_forget_runs_then_there_after_unwatching():
    watcher = SelectorThread("roving-test-selector")
    seen: "queue.Queue[tuple]" = queue.Queue()
    r, w = os.pipe()

    def readable():
        seen.put(("ready", threading.current_thread().name, os.read(r, 100)))

    watcher.watch(r, readable)
    os.write(w, b"one")
    assert seen.get(timeout=T) == ("ready", "roving-test-selector", b"one")
    closed = threading.Event()
    watcher.forget(r, lambda: (seen.put(("then", threading.current_thread().name, b"")), os.close(r),
                               closed.set()))
    assert closed.wait(T)
    assert seen.get(timeout=T) == ("then", "roving-test-selector", b"")
    # Watching a new file after the old one's number was closed there works (the selector forgot it).
    r2, w2 = os.pipe()
    watcher.watch(r2, lambda: seen.put(("ready2", "", os.read(r2, 100))))
    os.write(w2, b"two")
    assert seen.get(timeout=T) == ("ready2", "", b"two")
    for fd in (w, r2, w2):
        os.close(fd)


def test_a_handler_that_raises_is_no_longer_watched_and_the_other_files_go_on():
    watcher = SelectorThread("roving-test-selector-2")
    calls = {"bad": 0}
    good: "queue.Queue[bytes]" = queue.Queue()
    bad_r, bad_w = os.pipe()
    good_r, good_w = os.pipe()

    def bad():
        calls["bad"] += 1
        raise RuntimeError("broken handler")

    watcher.watch(bad_r, bad)
    watcher.watch(good_r, lambda: good.put(os.read(good_r, 100)))
    os.write(bad_w, b"x")  # stays readable: a handler still watched would be called again and again
    os.write(good_w, b"first")
    assert good.get(timeout=T) == b"first"
    os.write(good_w, b"second")
    assert good.get(timeout=T) == b"second"
    assert calls["bad"] == 1
    for fd in (bad_r, bad_w, good_r, good_w):
        os.close(fd)
