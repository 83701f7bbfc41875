"""The slow-node rule on its own: measured over planned compute against the median node, for a number
of iterations in a row."""

from roving.pipeline.runtime.slowness import SlowNodes

PLANNED = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 2.0, "idle": 0.01}


def test_a_node_slow_for_the_iterations_asked_is_reported_once_with_its_factor():
    rule = SlowNodes(factor=3.0, iterations=2)
    measured = {"a": 1.0, "b": 1.0, "c": 5.0, "d": 2.0, "idle": 9.0}
    assert rule.observe(PLANNED, measured) == {}, "one slow iteration is not enough"
    slow = rule.observe(PLANNED, measured)
    assert list(slow) == ["c"] and abs(slow["c"] - 5.0) < 1e-9, "5x the median ratio (1.0); idle is not judged"
    assert rule.observe(PLANNED, measured) == {}, "judged afresh after it was reported"


def test_a_fast_iteration_in_between_starts_the_count_again_and_few_nodes_are_never_judged():
    rule = SlowNodes(factor=3.0, iterations=2)
    slow, fine = {"a": 1.0, "b": 1.0, "c": 5.0, "d": 2.0}, {"a": 1.0, "b": 1.0, "c": 1.0, "d": 2.0}
    assert rule.observe(PLANNED, slow) == {} and rule.observe(PLANNED, fine) == {}
    assert rule.observe(PLANNED, slow) == {}
    assert rule.observe(PLANNED, slow) == {"c": 5.0}
    two = SlowNodes(factor=3.0, iterations=1)
    assert two.observe({"a": 1.0, "b": 1.0}, {"a": 1.0, "b": 50.0}) == {}
