"""Module-level functions that pool workers import by reference in tests/pool/test_pool.py (cheap to import)."""
from __future__ import annotations

import os
import signal
import threading
import time


def square(x):
    return x * x


def add(a, b):
    return a + b


def pid_after(seconds):
    time.sleep(seconds)
    return os.getpid()


def getpid(_=None):
    return os.getpid()


def fail_on(x, bad):
    if x == bad:
        raise ValueError(f"bad item {x}")
    return x


def raise_value_error(message):
    raise ValueError(message)


def kill_self(x):
    os.kill(os.getpid(), signal.SIGKILL)


def kill_if(x, bad):
    if x == bad:
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def unpicklable_if(x, bad):
    return threading.Lock() if x == bad else x


def sleep_square(x, seconds):
    time.sleep(seconds)
    return x * x


def slow_square_counting(x, seconds, log_dir):
    """Square after a pause; leaves a file per execution so tests can count how often items ran."""
    time.sleep(seconds)
    with open(os.path.join(log_dir, f"{x}.{os.getpid()}.{time.monotonic_ns()}"), "w"):
        pass
    return x * x


_initialized = None


def init_value(value):
    global _initialized
    _initialized = value


def initialized(_=None):
    return _initialized


def noop(x=None):
    return x


def _meta(**want):
    """roving.meta, imported late so that workers importing this module stay cheap."""
    import roving

    return roving.meta(**want)


@_meta(cpu=3, memory="256M")
def square_needing_three_cpus(x):
    return x * x


@_meta(cpu=1, memory="1.5GiB")
def square_needing_one_and_a_half_gib(x):
    return x * x


def sleep_square_1(x):
    time.sleep(0.3 if x else 0.0)
    return x * x


def slurm_array_task(seconds=0.0):
    """The Slurm job array and task this worker runs as (None outside an array), after a pause."""
    time.sleep(seconds)
    return os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")


def started_then_sleep(x, seconds, marker_dir):
    """Write ``marker_dir/started-<x>-<pid>`` (so a test knows the item runs, and where), then sleep;
    returns (x, the pid that finished it)."""
    import os
    import time

    open(os.path.join(marker_dir, f"started-{x}-{os.getpid()}"), "w").close()
    time.sleep(seconds)
    return x, os.getpid()


def started_then_sleep_the_first_runs(x, seconds, marker_dir, long_runs):
    """As :func:`started_then_sleep`, but only the first ``long_runs`` runs of item ``x`` (counted by their
    markers) sleep ``seconds``; a later run returns at once. For a test that ends those first runs mid-item
    and has no need to wait out the one that completes."""
    import os
    import time

    open(os.path.join(marker_dir, f"started-{x}-{os.getpid()}"), "w").close()
    if sum(1 for n in os.listdir(marker_dir) if n.startswith(f"started-{x}-")) <= long_runs:
        time.sleep(seconds)
    return x, os.getpid()


def sleep_then_pid(x, seconds):
    import os
    import time

    time.sleep(seconds)
    return x, os.getpid()


def fail_if_pid_is_not(pid):
    import os

    if os.getpid() != pid:
        raise RuntimeError(f"ran in {os.getpid()}, not {pid}")
    return "ran in the caller"


def die_unless_pid_is(pid):
    """SIGKILL the process running it unless it is ``pid`` (a worker crashes; the caller survives)."""
    import os
    import signal

    if os.getpid() != pid:
        os.kill(os.getpid(), signal.SIGKILL)
    return "survived in the caller"
