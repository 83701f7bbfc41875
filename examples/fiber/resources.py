"""Resources per worker with ``meta``: Fiber's ``memory=1000`` meant megabytes; roving wants the unit
written (``"1000M"``) and refuses a bare number with a message that says which unit to write.

    python examples/fiber/resources.py
"""
import roving as fiber  # was: import fiber


@fiber.meta(cpu=1, memory="256M")  # was: @fiber.meta(cpu=1, memory=256)
def square(x):
    return x * x


if __name__ == "__main__":
    with fiber.Pool(2) as pool:
        print("squares:", pool.map(square, range(5)))
    try:
        fiber.meta(memory=1000)
    except ValueError as exc:
        print("refused:", exc)
