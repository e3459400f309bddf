"""What the graph tests of both fronts share: a happens-before relation, closed and then reduced (the declaration in
cloob_core/ops/graph.py lists only direct predecessors)."""

from __future__ import annotations


def reduced(before: dict[str, set[str]]) -> dict[str, set[str]]:
    """``before`` (each step's predecessors) transitively closed, then reduced: nothing implied by another kept."""
    closure = {step: set(deps) for step, deps in before.items()}
    for _ in before:
        for step in closure:
            closure[step] |= set().union(*(closure[dep] for dep in closure[step]))
    return {step: {dep for dep in deps if not any(dep in closure[other] for other in deps if other != dep)}
            for step, deps in closure.items()}
