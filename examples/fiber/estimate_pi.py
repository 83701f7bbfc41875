"""Monte Carlo estimate of pi on a Pool, written as a Fiber program would be: ``import roving as fiber``.

    python examples/fiber/estimate_pi.py [SAMPLES]
"""
import random
import sys

import roving as fiber  # was: import fiber


def hits(seed: int, n: int = 20_000) -> int:
    """How many of ``n`` random points of the unit square fall inside the quarter circle."""
    rng = random.Random(seed)
    return sum(rng.random() ** 2 + rng.random() ** 2 < 1.0 for _ in range(n))


if __name__ == "__main__":
    samples = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
    chunks = max(1, samples // 20_000)
    with fiber.Pool(processes=2) as pool:
        inside = sum(pool.map(hits, range(chunks)))
    print(f"pi is about {4.0 * inside / (chunks * 20_000):.3f}")
