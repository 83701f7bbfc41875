"""The simulator's speed: CPU seconds (``time.process_time``, the least of 7 repeats) to simulate 18 fixed
plans (gcp12 and aws10, 12 to 40 nodes, 6 to 8 stages, ``random_skip`` plans) with the timeline, without it,
on shared cores and with the replicas' gradient bytes. CPU time, not wall time: on a loaded machine the
wall clock measures the other processes.

    PYTHONPATH=src python3 benchmarks/simulate_speed.py
"""
import time

from roving.pipeline import build_network, model_preset, random_skip, simulate
from roving.pipeline.planning.costs import gradient_bytes

VARIANTS = {"record": {}, "fast": {"record": False}, "shared": {"record": False, "shared_cores": 4},
            "sync": {"record": False, "sync_bytes": None}}


def main() -> None:
    model = model_preset("llama-1.5b")
    cases = []
    for netname in ("gcp12", "aws10"):
        for nodes, stages in ((12, 6), (24, 6), (40, 8)):
            net = build_network(netname, nodes, memory=2)
            alloc = {n.name: i % stages for i, n in enumerate(net.nodes)}
            for seed in range(3):
                plan = random_skip(net, model, alloc, stages, 0.25, 4 * nodes, seed=seed)
                cases.append((net, plan, gradient_bytes(model, stages)))
    best: dict[str, float] = {}
    for _ in range(7):
        for name, kw in VARIANTS.items():
            t0 = time.process_time()
            for net, plan, sync in cases:
                simulate(net, model, plan, **(dict(kw, sync_bytes=sync) if "sync_bytes" in kw else kw))
            best[name] = min(best.get(name, 1e9), time.process_time() - t0)
    print(" ".join(f"{k} {v:.3f}" for k, v in best.items()))


if __name__ == "__main__":
    main()
