"""`cloob train` under torchrun, started from a configuration validated once. The one-pod Kubeflow step with
several GPUs and the Training Operator's pods both write the validated configuration to one params file and run
the same command on it; every rank reads that file as it is, with no overrides to apply again."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import yaml

from cloob_core.config import CloobConfig, config_from_mapping

PARAMS_FILE = "params.yaml"


def config_text(config: CloobConfig) -> str:
    """The validated configuration as a params file (the form `cloob config` prints and params.yaml holds)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def on_gpus(config: CloobConfig, gpus: int) -> CloobConfig:
    """The configuration of a step or pod given ``gpus`` GPUs: ``train.device`` auto becomes cuda, so a pod whose
    CUDA does not work fails in one line instead of training on its CPU (an explicit cpu stays)."""
    if gpus < 1 or config.train.device != "auto":
        return config
    return config_from_mapping(config.model_dump(), values={"train": {"device": "cuda"}})


def torchrun_train(params_file: str, output: str, *, processes: int, nodes: int | None = None,
                   python: str = sys.executable, extra: Sequence[str] = ()) -> list[str]:
    """torchrun around `cloob train --params FILE`, ``processes`` per node: on this node alone (``nodes`` None),
    or on ``nodes`` nodes whose rendezvous the Training Operator's environment supplies."""
    rendezvous = ["--standalone"] if nodes is None else [f"--nnodes={nodes}"]
    return [python, "-m", "torch.distributed.run", *rendezvous, f"--nproc-per-node={processes}", "-m",
            "cloob_core.cli", "train", "--params", params_file, "--output", output, "--no-progress", *extra]
