"""A program that starts a BaseManager subclass with start() and never calls shutdown(): it must exit
once its work is done, as under multiprocessing (the server is stopped when the manager is collected,
or at exit). argv[1]: "function" (the manager is a local of a function that returns) or "global"
(it lives until exit). Prints the server's pid so the test can check it is gone too."""
import sys

import roving
from roving.managers import BaseManager


class Box:
    def __init__(self):
        self.value = 0

    def put(self, value):
        self.value = value

    def get(self):
        return self.value


class BoxManager(BaseManager):
    pass


BoxManager.register("Box", Box)


def work():
    manager = BoxManager()
    manager.start()
    box = manager.Box()
    box.put(41)
    print("result", box.get() + 1, flush=True)
    print("server", manager._process.pid, flush=True)
    return manager


if __name__ == "__main__":
    if sys.argv[1] == "function":
        work()
        print("returned", flush=True)
    else:
        kept = work()
        sync = roving.Manager()  # a SyncManager left running as well
        shared = sync.list([1])
        print("list", shared[:], flush=True)
