"""A program with a helper module of its own beside it (helper.py, not installed), for the code shipping
tests: a Pool maps helper.square and a Process runs helper.where; prints, as JSON, the results and where
each child found helper.py.

usage: main.py OPTIONS_JSON   (OPTIONS_JSON: roving.init's keyword arguments)
"""
import json
import sys

import helper

import roving

if __name__ == "__main__":
    roving.init(child_output="prefix", **json.loads(sys.argv[1]))
    with roving.Pool(2) as pool:
        squares = pool.map(helper.square, range(6))
        found = sorted(set(pool.map(helper.where, range(4))))
    q = roving.Queue()
    p = roving.Process(target=helper.report, args=(q,))
    p.start()
    said = q.get(timeout=120)
    p.join(60)
    print(json.dumps({"squares": squares, "pool_found": found, "process_found": said,
                      "exitcode": p.exitcode, "parent_found": helper.__file__}))
