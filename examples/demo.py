"""roving's main demo: a multiprocessing program, unchanged but for its import.

Workers take numbers from a JoinableQueue, send their squares back through a Queue, a pipe carries a
numpy array to a child and back, and every child's output reaches this terminal with its name in front.
Run it with ``python examples/demo.py``.
"""
import os
import time

import numpy as np

import roving as multiprocessing


def worker(tasks, results):
    name = multiprocessing.current_process().name
    print(f"{name} started (pid {os.getpid()})")
    while True:
        item = tasks.get()
        if item is None:
            tasks.task_done()
            break
        results.put((item, item * item, name))
        tasks.task_done()


def doubler(conn):
    array = conn.recv()
    conn.send(array * 2)
    conn.close()


def main():
    start = time.perf_counter()
    tasks, results = multiprocessing.JoinableQueue(), multiprocessing.Queue()
    workers = [multiprocessing.Process(target=worker, args=(tasks, results)) for _ in range(3)]
    for w in workers:
        w.start()
    for n in range(30):
        tasks.put(n)
    for _ in workers:
        tasks.put(None)
    tasks.join()
    squares = sorted(results.get(timeout=30) for _ in range(30))
    assert [s for _, s, _ in squares] == [n * n for n in range(30)]
    by_worker = {}
    for _, _, name in squares:
        by_worker[name] = by_worker.get(name, 0) + 1
    print(f"30 squares computed, by worker: {by_worker}")
    for w in workers:
        w.join(timeout=30)

    here, there = multiprocessing.Pipe()
    child = multiprocessing.Process(target=doubler, args=(there,))
    child.start()
    there.close()
    array = np.arange(4 * 1024 * 1024, dtype=np.float64)  # 32 MiB
    here.send(array)
    back = here.recv()
    child.join(timeout=30)
    assert np.array_equal(back, array * 2)
    print(f"a {array.nbytes >> 20} MiB array went through a pipe and back, doubled")
    print(f"exit codes: {[w.exitcode for w in workers + [child]]}; "
          f"demo took {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
