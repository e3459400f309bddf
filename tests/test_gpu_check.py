"""benchmarks/gpu_check.sh --quick: the GPU check's every section on the CPU with tiny sizes, so the script that a
GPU machine runs does not rot between the days one is at hand. One run per group of sections (each under a minute,
and spread over CI's workers), each with the lines its sections must print."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = {  # sections (7 is opt-in on a GPU) -> lines their results must hold
    "1": ("ours CLIP / open_clip_train", "CLOOB / CLIP"),
    "3": ("stage / step", "host syncs per step"),
    "7": ("twice the batch", "px JPEGs"),
    "4,5,6,10": ("bound", "gather with gradient: equal", "DDP, accum_freq 2", "bf16 compression hook: ran",
                 "resumed at step 2 of 4", "data positions as the uninterrupted run", "cloob data score",
                 "samples/s scored"),
    "8": ("cloob-tiny-vit cloob 8 steps (warm-up 2, retrieval from step", "cloob-tiny clip", "held-out R@5"),
    "9": ("cloob eval ", "CB defaults", "CB matched"),
}


# section 9 (CLIP_benchmark against `cloob eval`, ~35 s) runs in the slow phase, for the default one's budget
@pytest.mark.parametrize("sections", [pytest.param(s, marks=pytest.mark.slow) if s == "9" else s for s in EXPECTED])
def test_the_gpu_check_runs_every_section_in_its_quick_cpu_mode(sections, tmp_path):
    command = ["benchmarks/gpu_check.sh", "--quick", "--sections", sections]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = (tmp_path / "gpu_check.txt").read_text()
    for expected in (*EXPECTED[sections], "all sections ran"):
        assert expected in lines, expected
