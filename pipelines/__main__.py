"""`python -m pipelines compile …`: the pipeline as KFP IR YAML, for the Kubeflow UI, `kfp` or a GitOps repo.
(Submission and recurring runs: see the README's "Run on Kubernetes".)"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from cloob_core.io import atomic_write


def _compile(args: argparse.Namespace) -> int:
    from kfp import compiler

    from pipelines.pretrain import build

    selector = dict(item.split("=", 1) for item in args.node_selector)
    pipeline = build(partitions=args.partitions, gpus=args.gpus, accelerator=args.accelerator, cpu=args.cpu,
                     memory=args.memory, shm=args.shm, node_selector=selector, gpu_taint=args.gpu_taint or None,
                     s3_secret=args.s3_secret)
    with tempfile.TemporaryDirectory() as tmp:  # the compiler picks the format from the file name's suffix
        compiled = Path(tmp) / "pipeline.yaml"
        compiler.Compiler().compile(pipeline, str(compiled))
        atomic_write(args.output, lambda out: shutil.copyfile(compiled, out))
    print(f"wrote {args.output}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipelines", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    comp = sub.add_parser("compile", help="write the pretraining-and-evaluation pipeline as KFP YAML")
    comp.add_argument("--output", type=Path, default=Path("pipelines/compiled/pretrain_evaluate.yaml"))
    comp.add_argument("--partitions", type=int, default=2, help="download fan-out (default 2)")
    comp.add_argument("--gpus", type=int, default=1, help="GPUs of the training pod; >1 runs torchrun (default 1)")
    comp.add_argument("--accelerator", default="nvidia.com/gpu", help="accelerator resource (default nvidia.com/gpu)")
    comp.add_argument("--cpu", default="8", help="training pod CPU request (default 8)")
    comp.add_argument("--memory", default="32Gi", help="training pod memory request (default 32Gi)")
    comp.add_argument("--shm", default="16Gi", help="size of the memory-backed /dev/shm (default 16Gi)")
    comp.add_argument("--node-selector", action="append", default=[], metavar="KEY=VALUE",
                      help="node label the training pod needs (repeatable)")
    comp.add_argument("--gpu-taint", default="nvidia.com/gpu",
                      help="taint key the training pod tolerates ('' for none)")
    comp.add_argument("--s3-secret", default="cloob-s3", help="Kubernetes secret with the S3 credentials")
    comp.set_defaults(func=_compile)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
