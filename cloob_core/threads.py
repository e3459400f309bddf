"""How a stage shares the cores it may use between torch's thread pools and its data-loader workers.

"The cores" are the ones this process may run on: its CPU affinity and, in a container, its cgroup CPU quota
(joblib's loky reads both, and ``LOKY_MAX_CPU_COUNT``): a pod limited to 4 CPUs on a 64-core node gets 4, not the
64 torch would start by default. Ranks of one node (``LOCAL_WORLD_SIZE``) split them evenly.

Why this is set and not left to torch: on a 2-core machine the default (one intra-op thread per core in the main
process, beside data-loader workers decoding on the same cores) spends the step's time waiting, and on a loaded
machine OpenMP's spinning threads collapse it (docs/training.md, "Threads"). The budget:

- on the CPU, the step gets every core of its share and the workers run in its gaps: with the default model the
  workers cost about a third of the step's time per sample, and leaving them a core of two was slower (520
  against 640 samples/s, docs/performance.md "The training stage");
- on a GPU, the step's threads only launch kernels: the workers get the cores, the step what is left (at least 1);
- evaluation embeds an image set with data-loader workers (:func:`plan_eval_threads`), torch on the rest.

``LOKY_MAX_CPU_COUNT`` caps the cores of every stage; ``train.threads`` sets the training step's threads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger(__name__)

# libgomp's threads spin this many times at a barrier before they sleep; it reads the count once, when torch loads
# it. Its default, 300,000 (~1 ms), is what collapses a loaded machine: a thread spins while the partner it waits
# for has no core. The count that suits a process follows the grain of its work (docs/performance.md):
# - "fine", many small ops back to back (a training step, image encoding): 10,000 lost nothing on a quiet machine
#   and kept the step at its single-thread speed under a load of 6 on 2 cores; 100 cost the quiet step 17%, as the
#   threads then sleep between ops and each op waits for one to wake;
# - "coarse", a few large ops (the linear probe's solver): under the load the probe took 17 s instead of 29 s
#   with 100 (medians of 4), and quiet 4.5 s against 4.3 (medians of 8, within the machine's noise).
SPIN_COUNTS = {"fine": "10000", "coarse": "100"}
# A value the user set wins; one of ours was inherited from a parent process that imported cloob_core.
_USER_SPIN_COUNT = os.environ.get("GOMP_SPINCOUNT")
if _USER_SPIN_COUNT in SPIN_COUNTS.values():
    _USER_SPIN_COUNT = None


def limit_spinning(grain: Literal["fine", "coarse"] = "fine") -> None:
    """Cap OpenMP's spinning for work of this grain (``SPIN_COUNTS``), unless the user set ``GOMP_SPINCOUNT``.
    Effective only before torch is imported (``cloob_core`` sets "fine" on import; an evaluation command sets
    "coarse" before its imports)."""
    if _USER_SPIN_COUNT is None and "torch" not in sys.modules:
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNTS[grain]


def usable_cores() -> int:
    """Cores this process may use: CPU affinity, cgroup quota (rounded up) and ``LOKY_MAX_CPU_COUNT``."""
    from joblib.externals.loky import cpu_count

    return max(1, cpu_count())


def local_ranks(environ: dict[str, str] | None = None) -> int:
    """Processes of this job on this node (torchrun's ``LOCAL_WORLD_SIZE``; SLURM's tasks per node)."""
    env = os.environ if environ is None else environ
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        if env.get(key, "").isdigit() and int(env[key]) > 0:
            return int(env[key])
    return 1


def core_share(cores: int | None = None, ranks_here: int | None = None) -> int:
    """One rank's share of the cores: ``cores`` (default :func:`usable_cores`) over the ranks on this node."""
    return max(1, (cores or usable_cores()) // (ranks_here or local_ranks()))


@dataclass(frozen=True)
class ThreadBudget:
    cores: int  # this process's share of the usable cores
    torch_threads: int  # torch intra-op (and inter-op) threads of the main process
    workers: int  # data-loader worker processes (one torch thread each)

    def apply(self) -> ThreadBudget:
        import torch

        torch.set_num_threads(self.torch_threads)
        if torch.get_num_interop_threads() != self.torch_threads:
            # settable once, before any inter-op work: a second stage in one process keeps the first's
            with contextlib.suppress(RuntimeError):
                torch.set_num_interop_threads(self.torch_threads)
        log.info("threads: %d core(s) for this process, %d torch thread(s), %d data-loader worker(s)", self.cores,
                 self.torch_threads, self.workers)
        return self


def plan_threads(torch_threads: int = 0, *, workers: int = 0, device_type: str = "cpu", cores: int | None = None,
                 ranks_here: int | None = None) -> ThreadBudget:
    """The budget of one process: ``torch_threads`` as configured (0: derived, see the module); ``cores`` and
    ``ranks_here`` default to :func:`usable_cores` and :func:`local_ranks`."""
    share = core_share(cores, ranks_here)
    if torch_threads:
        threads = torch_threads
    elif device_type == "cuda":
        threads = max(1, share - workers)
    else:
        threads = share
    return ThreadBudget(cores=share, torch_threads=threads, workers=workers)


def plan_eval_threads(device_type: str, workers: int | None = None, cores: int | None = None,
                      ranks_here: int | None = None) -> ThreadBudget:
    """The budget of embedding an image set: data-loader workers decode and transform the images (``workers``;
    None: on a GPU every core of the share but one, which launches the kernels; on the CPU one per core). On a GPU
    torch gets the cores the workers leave, at least one; on the CPU it starts with every core of the share, and
    :class:`CoreBalance` moves cores between the two as the run shows which one it waits for."""
    share = core_share(cores, ranks_here)
    if workers is None:
        workers = max(1, share - 1) if device_type == "cuda" else share
    threads = max(1, share - workers) if device_type == "cuda" or not workers else share
    return ThreadBudget(cores=share, torch_threads=threads, workers=workers)


@dataclass
class CoreBalance:
    """On the CPU, torch's threads beside the data-loader workers, set by what the embedding loop waits for. A small
    model is decoding-bound: the loop waits for images, and each core torch holds slows the workers down (10,000
    photos with cloob-tiny on 2 cores: 10.1 s with 1 torch thread beside 2 workers, 13.3-15.3 s with 2); a large
    one is bound by its forward pass, and the workers idle (1,000 photos with ViT-B-32: 59 s with 2 torch threads,
    111 s with 1). Every ``window`` batches: the loop waited more than a fifth of the time, one thread fewer; less
    than a twentieth, one more (up to the share)."""

    cores: int
    threads: int
    window: int = 4
    waited: float = 0.0
    computed: float = 0.0
    batches: int = 0

    def record(self, waited: float, computed: float) -> None:
        import torch

        self.waited, self.computed, self.batches = self.waited + waited, self.computed + computed, self.batches + 1
        if self.batches < self.window:
            return
        waiting = self.waited / max(self.waited + self.computed, 1e-9)
        threads = self.threads - 1 if waiting > 0.2 else self.threads + 1 if waiting < 0.05 else self.threads
        threads = min(max(threads, 1), self.cores)
        if threads != self.threads:
            log.debug("embedding waited %.0f%% of the time for images: %d torch thread(s)", 100 * waiting, threads)
            torch.set_num_threads(threads)
        self.threads, self.waited, self.computed, self.batches = threads, 0.0, 0.0, 0
