"""A Process that sends its answer through a SimpleQueue, and one the program never joins: as in
multiprocessing (and Fiber), the end of the program waits for it.

    python examples/fiber/process_and_queue.py
"""
import roving as fiber  # was: import fiber


def add(q, a, b):
    q.put(a + b)


def greet(name):
    print(f"hello from the child, {name}", flush=True)


if __name__ == "__main__":
    q = fiber.SimpleQueue()
    p = fiber.Process(target=add, args=(q, 40, 2))
    p.start()
    print(f"the child says {q.get()}")
    p.join()
    fiber.Process(target=greet, args=("never joined",)).start()  # joined at the program's end
