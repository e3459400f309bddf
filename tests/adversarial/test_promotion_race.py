"""Concurrent promotion gates, as scheduled retraining runs can start them: real processes, released at one
instant, into one store on local disk and on the loopback S3 server. Production must end at the best candidate
that passed, and production, each gate's printed decision and the history must agree."""

from __future__ import annotations

import random

import pytest
from gates import METRIC, check_agreement, run_gates

TRIALS = 20


def run_trial(store: str, root, rng: random.Random) -> None:
    values = rng.sample([0.30, 0.40, 0.50, 0.60, 0.70], rng.randint(2, 4))  # apart by more than min_improvement
    gates = run_gates(store, root, values)
    production = check_agreement(store, gates)
    from cloob_core.ops import promotion

    best = max(gates, key=lambda gate: gate.value)
    assert production["model_id"] == promotion.model_id(best.model), [g.printed for g in gates]
    assert production["metrics"][METRIC] == best.value


# the S3 case takes ~50 s (a moto server's latency on every conditional write): in the slow phase, to keep the default
# one within CI's budget (docs/development.md)
@pytest.mark.parametrize("backend", ["local", pytest.param("s3", marks=pytest.mark.slow)])
def test_concurrent_gates_leave_the_best_candidate_in_production(backend, tmp_path, request):
    rng = random.Random(13)
    for trial in range(TRIALS):
        if backend == "local":
            store = str(tmp_path / f"store{trial}")
        else:
            bucket = request.getfixturevalue("s3_bucket")
            store = f"s3://{bucket}/trial{trial}"
        run_trial(store, tmp_path / f"trial{trial}", rng)
