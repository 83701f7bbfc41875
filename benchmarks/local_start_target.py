"""The target of benchmarks/local_start.py's children: a module that imports torch, as a SkipPipe stage's
does, and a function that sends one value back."""
import torch  # noqa: F401  (what the children pay to import, or not)


def answer(q, i):
    q.put(i)
