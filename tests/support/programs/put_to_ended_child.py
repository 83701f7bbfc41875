"""A parent that puts two items on a queue its child owns; the child takes one and ends; the parent
joins it and exits. The second item went with the child: the parent's exit must not wait for it."""
import roving


def own_queue(ready):
    q = roving.Queue()
    ready.put(q)
    q.get()


if __name__ == "__main__":
    ready = roving.Queue()
    p = roving.Process(target=own_queue, args=(ready,))
    p.start()
    q = ready.get(timeout=60)
    q.put("taken")
    q.put("left behind")
    p.join(60)
    print("joined", p.exitcode, flush=True)
