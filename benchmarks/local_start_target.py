"""The target of benchmarks/local_start.py's children: a module that imports torch, as a SkipPipe stage's
does, and a function that sends back the CPU seconds its process had spent before it ran."""
import time

import torch  # noqa: F401  (what the children pay to import, or not)


def answer(q, i):
    q.put((i, time.process_time()))
