"""An object served by an AsyncManager, called through its proxy: each proxy's calls run in the order they
were made (``reset`` before ``step``), different proxies' at the same time.

    python examples/fiber/async_manager.py
"""
from roving.managers import AsyncManager  # was: from fiber.managers import AsyncManager


class Counter:
    """A tiny environment: ``reset`` sets it to zero, ``step`` adds one and says where it is."""

    def __init__(self):
        self.value = None

    def reset(self):
        self.value = 0
        return self.value

    def step(self):
        self.value += 1
        return self.value


class CounterManager(AsyncManager):
    pass


CounterManager.register("Counter", Counter)

if __name__ == "__main__":
    managers = [CounterManager() for _ in range(2)]
    for m in managers:
        m.start()
    counters = [m.Counter() for m in managers]
    handles = [c.reset() for c in counters] + [c.step() for c in counters] + [c.step() for c in counters]
    print("results:", [h.get() for h in handles])
    for m in managers:
        m.shutdown()
