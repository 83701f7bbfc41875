"""A small program written for the standard multiprocessing module (test_compat runs it unchanged,
and with its import line replaced by ``import roving as multiprocessing``). Only the parent prints."""
import multiprocessing
import queue
import sys
import time


def square_worker(tasks, results):
    while True:
        item = tasks.get()
        if item is None:
            tasks.task_done()
            break
        results.put((item, item * item))
        tasks.task_done()


def pipe_worker(conn):
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        conn.send(("echo", msg))
    conn.close()


def writer(conn, n):
    for i in range(n):
        conn.send_bytes(str(i).encode())
    conn.close()


def exiter(code):
    sys.exit(code)


def failer():
    raise RuntimeError("expected failure")


def sleeper():
    time.sleep(60)


class Counter(multiprocessing.Process):
    def __init__(self, results, n):
        super().__init__()
        self.results, self.n = results, n

    def run(self):
        self.results.put(("counted", sum(range(self.n))))


def main():
    # JoinableQueue with a pool of workers
    tasks, results = multiprocessing.JoinableQueue(), multiprocessing.Queue()
    workers = [multiprocessing.Process(target=square_worker, args=(tasks, results)) for _ in range(3)]
    for w in workers:
        w.start()
    for i in range(20):
        tasks.put(i)
    for _ in workers:
        tasks.put(None)
    tasks.join()
    squares = sorted(results.get(timeout=30) for _ in range(20))
    print("squares", squares)
    for w in workers:
        w.join(30)
    print("worker exitcodes", [w.exitcode for w in workers])

    # Process subclass
    c = Counter(results, 101)
    c.start()
    print("subclass", results.get(timeout=30))
    c.join(30)
    print("subclass exitcode", c.exitcode)

    # duplex Pipe, then EOF once the child's end is closed
    parent_end, child_end = multiprocessing.Pipe()
    p = multiprocessing.Process(target=pipe_worker, args=(child_end,))
    p.start()
    child_end.close()
    for msg in ["a", 1, (2, 3)]:
        parent_end.send(msg)
        print("pipe", parent_end.recv())
    parent_end.send("stop")
    try:
        parent_end.recv()
    except EOFError:
        print("pipe EOFError")
    parent_end.close()
    p.join(30)
    print("pipe worker exitcode", p.exitcode)

    # one-way Pipe, bytes, EOF after the writer exits
    r, w = multiprocessing.Pipe(duplex=False)
    p = multiprocessing.Process(target=writer, args=(w, 5))
    p.start()
    w.close()
    got = []
    while True:
        try:
            got.append(r.recv_bytes())
        except EOFError:
            break
    p.join(30)
    print("bytes", got)

    # exit codes
    procs = [multiprocessing.Process(target=exiter, args=(code,)) for code in (0, 3, None)]
    procs.append(multiprocessing.Process(target=failer))
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    print("exitcodes", [p.exitcode for p in procs])

    # terminate, kill, join with timeout, is_alive
    s1, s2 = multiprocessing.Process(target=sleeper), multiprocessing.Process(target=sleeper)
    s1.start()
    s2.start()
    s1.join(0.1)
    print("alive", s1.is_alive(), s1.exitcode)
    s1.terminate()
    s2.kill()
    s1.join(30)
    s2.join(30)
    print("signalled", s1.exitcode, s2.exitcode, s1.is_alive())

    # bounded Queue errors, close
    q = multiprocessing.Queue(maxsize=1)
    q.put("x")
    try:
        q.put("y", timeout=0.1)
    except queue.Full:
        print("full raised")
    print("got", q.get(timeout=30))
    try:
        q.get(timeout=0.1)
    except queue.Empty:
        print("empty raised")
    q.close()
    try:
        q.put("z")
    except ValueError:
        print("closed put raised ValueError")
    q.join_thread()

    print("current", multiprocessing.current_process().name, multiprocessing.parent_process())
    print("children left", multiprocessing.active_children())


if __name__ == "__main__":
    main()
