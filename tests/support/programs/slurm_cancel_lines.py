"""A parent on the slurm backend. `pool`: a Pool that ends normally (roving cancels its workers' jobs).
`sleeper FILE`: a child that sleeps, its job id written to FILE, until someone cancels it from outside."""
import sys

import roving


def sleep_long():
    import time

    time.sleep(120)


if __name__ == "__main__":
    roving.init(backend="slurm")
    if sys.argv[1] == "pool":
        for _ in range(2):
            with roving.Pool(2) as pool:
                print("result", pool.map(abs, [-1, -2, 3]), flush=True)
            pool.join()
        print("done", flush=True)
    else:
        p = roving.Process(target=sleep_long, name="sleeper")
        p.start()
        with open(sys.argv[2] + ".tmp", "w") as f:
            f.write(p.job.id)
        import os

        os.rename(sys.argv[2] + ".tmp", sys.argv[2])
        p.join(100)
        print("exitcode", p.exitcode, flush=True)
        import time

        time.sleep(1.5)  # the follower prints the job's last lines
