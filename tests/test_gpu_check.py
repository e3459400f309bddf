"""benchmarks/gpu_check.sh --quick: the GPU check's every section on the CPU with tiny sizes, so the script that a
GPU machine runs does not rot between the days one is at hand."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_every_section_in_its_quick_cpu_mode(tmp_path):
    command = ["benchmarks/gpu_check.sh", "--quick", "--sections", "1,3,4,5,6,7,8,9"]  # 7 is opt-in on a GPU
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = (tmp_path / "gpu_check.txt").read_text()
    for expected in ("ours CLIP / open_clip_train", "CLOOB / CLIP", "stage / step", "host syncs per step",
                     "cloob ", "bound", "gather with gradient: equal", "DDP, accum_freq 2", "resumed at step 2 of 4",
                     "data positions as the uninterrupted run", "bf16 compression hook: ran", "twice the batch",
                     "px JPEGs", "cloob-tiny-vit cloob 8 steps", "cloob-tiny clip", "held-out R@5",
                     "cloob eval ", "CB defaults", "CB matched",
                     "all sections ran"):
        assert expected in lines, expected
