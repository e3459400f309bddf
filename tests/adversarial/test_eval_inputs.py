"""Evaluation inputs a user meets at night: labels outside the class set, a caption left empty, a tar cut inside a
member, a full disk under the features spool; and the cache's outputs, the same bytes for the same contents."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

_WRITE_ENTRY = """
import sys, torch
from cloob_core.evaluation.features import Embedded
from cloob_core.io import write_torch
entry = Embedded(torch.ones(3, 4), [0, 1, 2], [["a"], ["b"], ["c"]], {0: "zero"}, 1, "fp32")
write_torch(sys.argv[1], entry.as_saved())
"""


def test_a_features_cache_entry_is_the_same_bytes_in_every_process(tmp_path):
    """Its fields were saved in a frozenset's order, which changes with each process's hash seed: DVC and any
    content-addressed store saw a change where there was none."""
    digests = set()
    for seed in range(3):
        path = tmp_path / f"entry-{seed}.pt"
        subprocess.run([sys.executable, "-c", _WRITE_ENTRY, str(path)], check=True,
                       env={**os.environ, "PYTHONHASHSEED": str(seed)})
        digests.add(hashlib.sha256(path.read_bytes()).hexdigest())
    assert len(digests) == 1
