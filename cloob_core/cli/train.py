"""``cloob train``: pretrain on WebDataset shards (one process, or one rank of torchrun, the Training Operator or
SLURM) through cloob_core.training.loop.train."""

from __future__ import annotations

import argparse

from cloob_core.cli.options import add_command, add_config_options, config_of, layers_of
from cloob_core.config import PRESETS


def _train(args: argparse.Namespace) -> int:
    """Train the dual encoder on shards from `cloob data`. Launch with torchrun (or under the Kubeflow Training Operator
    or SLURM) for several GPUs or nodes; a plain call is one process on the CPU or one GPU. Writes OUTPUT/model
    (open_clip_config.json, open_clip_model.safetensors, model_info.json: open_clip loads it as local-dir:OUTPUT/model),
    checkpoints/, metrics.json, loss_history.csv, training_curves.png and tensorboard/."""
    from cloob_core.training.loop import train
    from cloob_core.training.resumption import resumed_config

    config = resumed_config(layers_of(args, preset=args.preset), args.output, args.resume)
    result = train(config, args.output, resume=args.resume, progress=not args.no_progress, publish=args.publish)
    if not result.is_main:
        return 0
    metrics = result.metrics
    print(f"objective {metrics['objective']}, {metrics['steps']} steps of {metrics['batch_size']} pairs "
          f"({metrics['world_size']} rank(s)), final loss {metrics['final_loss']:.4f}, "
          f"{metrics['samples_per_second']:.1f} samples/s")
    print(f"wrote {args.output}/model (open_clip's local-dir: folder), metrics.json, loss_history.csv, "
          "training_curves.png, checkpoints/")
    if args.publish:
        print(f"published {len(result.published)} files (all but checkpoints/) to {args.publish} as one unit")
    return 0


def _starting_weights(args: argparse.Namespace) -> int:
    """Write which weights train.init_from names now (the value, the weights file, its SHA-256) to OUTPUT: the
    DVC train stage depends on this file, so a new production model or overwritten weights re-run training even
    when train.init_from keeps its value."""
    from cloob_core.model.starting_weights import record_starting_weights

    config = config_of(args)
    record = record_starting_weights(config.train.init_from, config.promote.store, args.output)
    print(f"starting weights: {record.init_from} ({record.weights}, sha256 {record.sha256[:16]})" if record.init_from
          else "starting weights: none (train.init_from is not set: random weights)")
    print(f"wrote {args.output}")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "train", _train,
                         "pretrain with CLOOB (or another objective) on WebDataset shards; single process, torchrun or "
                         "SLURM")
    parser.add_argument("--output", default="runs/train", help="output folder (default: runs/train)")
    parser.add_argument("--resume", metavar="latest|auto|PATH",
                        help="continue from a checkpoint, with the run's configuration taken from it (a flag that "
                        "would change the run is refused): 'latest' (OUTPUT/checkpoints, then train.checkpoint_sync) "
                        "or a path / s3:// URL; 'auto': the latest when it is of this configuration, data and code, "
                        "else start afresh (how DVC re-runs an interrupted stage)")
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="the paper's recipe for CC3M (batch 512, lr 1e-3, warmup 20k, beta 8, 31 epochs in 4 "
                        "cycles) or YFCC (1024, 5e-4, 10k, 14.3, 28 epochs), RN50; or vit-b: open_clip's "
                        "ViT-B-32 optimiser recipe (lr 5e-4, warmup 2,000, weight decay 0.2); or vit-b-cpu: ViT-B-32 "
                        "from scratch on a CPU (batch 32, lr 1e-4, warmup 10, 120 steps); applied over --params, "
                        "under --set")
    parser.add_argument("--publish", metavar="URL",
                        help="after training, rank 0 publishes OUTPUT (all but checkpoints/) to this local folder or "
                        "s3:// prefix as one unit (readers see the previous set or this one, never a mix): how "
                        "pods of a multi-node job hand their result back")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_config_options(parser, "train", "model")
    weights = add_command(sub, "starting-weights", _starting_weights,
                          "record which weights train.init_from names and their SHA-256 (the DVC train stage's "
                          "dependency on their content)")
    weights.add_argument("--output", default="models/starting_weights.json",
                         help="the record (default: models/starting_weights.json)")
    add_config_options(weights)
