"""A roving parent that starts a non-daemonic child and ends without joining it, as multiprocessing allows
(the parent's exit joins it); the child prints a line at its end.

usage: unjoined_child.py BACKEND OPTIONS_JSON
"""
import json
import sys

import roving


def child(line):
    print(line, flush=True)


if __name__ == "__main__":
    backend, options = sys.argv[1], json.loads(sys.argv[2])
    roving.init(backend=backend, child_output="prefix", **options)
    roving.Process(target=child, args=("the unjoined child ran to its end",), name="Unjoined").start()
    print("the parent's last line", flush=True)
