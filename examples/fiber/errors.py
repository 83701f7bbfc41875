"""What a Pool retries: a task that raises is returned to the caller with its exception (never retried);
a task whose worker dies is run again on another worker, at most ``max_task_retries`` times.

    python examples/fiber/errors.py MARKER_DIR
"""
import os
import sys

import roving as fiber  # was: import fiber


def fragile(x):
    if x == 3:
        raise ValueError("no threes")
    return x


def dies_once(marker_dir, x):
    """The first run of item 1 kills its worker; the run on the next worker succeeds."""
    marker = os.path.join(marker_dir, "died")
    if x == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(9)
    return x * 10


if __name__ == "__main__":
    with fiber.Pool(2, max_task_retries=3) as pool:
        try:
            pool.map(fragile, range(5))
        except ValueError as exc:
            print("the task's own error, returned:", exc)
        print("a worker died and its task ran again:", pool.starmap(dies_once, [(sys.argv[1], x) for x in range(3)]))
