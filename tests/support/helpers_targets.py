"""Module-level targets for roving child processes used by the core tests.

The children import this module by reference (tests/ is on the parent's sys.path, which children take on),
so it must stay cheap to import: no pytest, no test modules.
"""
from __future__ import annotations

import os
import queue
import sys
import time

import roving

TIMEOUT = 30  # every blocking call in a child is bounded too


def put_value(q, value):
    q.put(value)


def double_from_to(inq, outq):
    outq.put(inq.get(timeout=TIMEOUT) * 2)


def echo_once(inq, outq):
    """Parent → child → parent: take one item and send it back unchanged."""
    outq.put(inq.get(timeout=TIMEOUT))


def sleep_for(seconds):
    time.sleep(seconds)


def exit_with(code):
    sys.exit(code)


def return_normally():
    return 42


def raise_value_error(message):
    raise ValueError(message)


def print_lines(out_lines, err_lines):
    for line in out_lines:
        print(line)
    for line in err_lines:
        print(line, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()


def report_pid_then_wait(reported, go):
    """Put ``os.getpid()`` (the child's number where it runs) on ``reported``, then wait on ``go``."""
    reported.put(os.getpid())
    go.get()


def print_then_wait(line, printed, go):
    """Print ``line``, say so on ``printed``, then wait on ``go`` (for ever, if nothing comes)."""
    print(line)
    sys.stdout.flush()
    printed.put(True)
    go.get()


def report_identity(q):
    me = roving.current_process()
    parent = roving.parent_process()
    q.put({
        "name": me.name,
        "pid": me.pid,
        "os_pid": os.getpid(),
        "daemon": me.daemon,
        "authkey": me.authkey,
        "parent_name": parent.name if parent is not None else None,
        "parent_pid": parent.pid if parent is not None else None,
        "parent_alive": parent.is_alive() if parent is not None else None,
    })


def report_config(q):
    cfg = roving.config.current()
    q.put({"heartbeat_interval": cfg.heartbeat_interval, "parent_timeout": cfg.parent_timeout,
           "child_output": cfg.child_output})


class DoublingProcess(roving.Process):
    """A Process subclass that overrides run(), as multiprocessing programs do."""

    def __init__(self, q, value):
        super().__init__()
        self.q = q
        self.value = value

    def run(self):
        self.q.put(("run override", self.value * 2, roving.current_process().name))


# -- queues ------------------------------------------------------------------------------------

def get_once_then_sleep(q, outq, seconds):
    """Take one item, report it, then stop reading for a long time (a reader that is not reading)."""
    outq.put(("sleeper got", q.get(timeout=TIMEOUT)))
    time.sleep(seconds)


def read_n(q, outq, n):
    outq.put(("reader got", [q.get(timeout=TIMEOUT) for _ in range(n)]))


def get_with_timeout_then_retry(q, outq, first_timeout):
    """A get that times out must not swallow an item put afterwards: the retry receives it."""
    try:
        item = q.get(timeout=first_timeout)
        outq.put(("first get returned", item))
    except queue.Empty:
        outq.put(("first get timed out", None))
    outq.put(("retry got", q.get(timeout=TIMEOUT)))


def consume_joinable(jq, outq, n):
    got = []
    for _ in range(n):
        got.append(jq.get(timeout=TIMEOUT))
        jq.task_done()
    outq.put(sorted(got))


def put_many(q, start, n):
    for i in range(start, start + n):
        q.put(i)


def simple_queue_echo(inq, outq):
    outq.put(("simple", inq.get()))


# -- pipes -------------------------------------------------------------------------------------

def pipe_echo(conn, n):
    """Answer n messages with (message, 'echo'), then close."""
    for _ in range(n):
        conn.send((conn.recv(), "echo"))
    conn.close()


def send_then_close(conn, items):
    for item in items:
        conn.send(item)
    conn.close()


def send_then_exit(conn, items):
    """Send, then exit without closing: the process's end counts as closed once it has ended."""
    for item in items:
        conn.send(item)


def send_bytes_pieces(conn, data, offset, size):
    conn.send_bytes(data, offset, size)
    conn.close()


def ready_then_sleep(conn, seconds):
    """Hold a pipe end, say so, then sleep (to be killed or terminated)."""
    conn.send("ready")
    time.sleep(seconds)


def recv_all_until_eof(conn, outq):
    got = []
    while True:
        try:
            got.append(conn.recv())
        except EOFError:
            break
    outq.put(("until eof", got))


def conn_from_queue_send(q, message):
    """Receive a Connection inside a queue message, then use it."""
    conn = q.get(timeout=TIMEOUT)
    conn.send(message)
    conn.close()


# -- bad input ---------------------------------------------------------------------------------

class Evil:
    """Unpickling this creates ``path``: the proof that someone unpickled it."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def put_from_many_threads(q, count, out):
    """Put one item from each of ``count`` threads started one after another; report how many
    connections this process keeps open at the end."""
    import threading

    from roving.transport import endpoint

    for i in range(count):
        thread = threading.Thread(target=q.put, args=(i,))
        thread.start()
        thread.join()
    out.put(len(endpoint._open_connections))


def report_environment(out, go=None):
    """Put this process's environment; then wait for ``go``, so that the parent can look at the job
    while it runs."""
    out.put(dict(os.environ))
    if go is not None:
        go.get(timeout=TIMEOUT)


def make_file_and_report_mode(path, out):
    """Create ``path`` as a program would (plain open) and report its permission bits."""
    with open(path, "w") as f:
        f.write("x")
    print("a line for the job's output", flush=True)
    out.put(os.stat(path).st_mode & 0o777)


def tell_node_who_i_am(address, op, stream, q):
    """Send one message to the handler ``op`` of the node at ``address`` over a channel made with this
    process's own credentials, wait for its answer, and report what this process knows of itself."""
    from roving.transport import channel, session

    me = session.current()
    chan = channel.Channel(address, me.credentials, TIMEOUT, stream=stream)
    try:
        chan.send([op])
        answer = chan.recv(TIMEOUT)
    finally:
        chan.close()
    q.put({"uid": me.uid, "node_id": me.credentials.node_id, "holds_ca": me.credentials.authority is not None,
           "answered": answer is not None, "address": me.node().address})


def home_a_queue_until(back, release):
    """Makes a Queue (homed in this process), hands it back on ``back``, takes the first item put on it
    and hands that back too, then stays until ``release`` is set."""
    q = roving.Queue()
    back.put(q)
    back.put(("got", q.get(timeout=120)))
    release.wait(600)


def report_process(q, probe_module=None, variable=None):
    """Puts what a child was started with: its pid and parent's, directory, first sys.path entry, a
    variable of its environment, whether ``probe_module`` was imported before its target ran, two random
    draws (``random`` and, when imported, numpy's), its argv, and a string's hash (``PYTHONHASHSEED``'s)."""
    import random
    import sys

    numpy = sys.modules.get("numpy")
    q.put({"pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(), "path0": sys.path[0],
           "variable": os.environ.get(variable) if variable else None,
           "probe": probe_module in sys.modules if probe_module else None,
           "random": random.random(), "numpy": float(numpy.random.random()) if numpy else None,
           "argv": list(sys.argv), "main": sys.modules["__main__"].__name__, "hash": hash("roving")})
    print(f"reported from {os.getpid()}", flush=True)


def exit_after(seconds, code):
    time.sleep(seconds)
    sys.exit(code)
