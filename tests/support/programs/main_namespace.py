"""A program whose Pool initializer sets a __main__ global that the task (and a helper) read.

Under multiprocessing's spawn the worker re-imports this script, so all its functions share one module
namespace; roving sends them by value and must give them one shared namespace too.
"""
import sys

if sys.argv[1:] == ["stdlib"]:
    import multiprocessing
    multiprocessing = multiprocessing.get_context("spawn")
else:
    import roving as multiprocessing

_model = None
calls = 0


def helper(x):
    return _model * x


def init(scale):
    global _model
    _model = scale


def task(x):
    global calls
    calls += 1
    return helper(x), calls


def fact(n):
    return 1 if n <= 1 else n * fact(n - 1)


if __name__ == "__main__":
    with multiprocessing.Pool(1, initializer=init, initargs=(10,)) as pool:
        print(pool.map(task, [1, 2, 3]))
        print(pool.apply(fact, (5,)))
