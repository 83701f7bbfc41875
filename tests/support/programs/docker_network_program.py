"""A roving parent on the docker backend with containers on the Docker network DOCKER_NETWORK: a Pool of 2
workers maps over 6 items, and a child Process makes a Queue of its own (homed in its container), hands it
to the parent through a parent's queue and puts an item on it, which the parent reads. Prints, as JSON, the
parent's advertised address and what the workers and the child said (hostname, address).

usage: docker_network_program.py OPTIONS_JSON   (OPTIONS_JSON: roving.init's keyword arguments)

A program of its own because a process's roving endpoint binds once, with the options of its first use.
"""
import json
import socket
import sys

import roving
from roving.transport import session


def where(x):
    name = socket.gethostname()
    return name, socket.gethostbyname(name), x * x


def own_queue(back, done):
    mine = roving.Queue()
    back.put(mine)
    name = socket.gethostname()
    mine.put(("from the child's own queue", name, socket.gethostbyname(name)))
    done.get(timeout=60)  # the queue lives in this process: stay until the parent has read it


if __name__ == "__main__":
    roving.init(child_output="off", **json.loads(sys.argv[1]))
    with roving.Pool(2) as pool:
        results = pool.map_async(where, range(6)).get(120)
    back, done = roving.Queue(), roving.Queue()
    child = roving.Process(target=own_queue, args=(back, done))
    child.start()
    said = back.get(timeout=120).get(timeout=60)
    done.put(True)
    child.join(60)
    print(json.dumps({"advertised": session.current().address().advertise, "results": results,
                      "child": said, "child_exitcode": child.exitcode}))
