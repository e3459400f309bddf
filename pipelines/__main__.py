"""`python -m pipelines compile|inputs|run-local|preflight|submit|schedule …`: the pipeline as KFP YAML, what its
steps copy in, a run of it on this machine (in the images or as subprocesses), what a cluster says of its training
job, a run of it on a KFP endpoint, and recurring runs (scheduled retraining / re-evaluation)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from cloob_core.config import ConfigError
from cloob_core.config.cluster import ClusterSettings
from cloob_core.errors import StageError, fail, user_facing
from cloob_core.flags import add_model_flags, flag_values
from cloob_core.io import atomic_write
from cloob_core.ops.cluster import check_cron
from pipelines.client import DEFAULT_TIMEOUT_S


def _compile(args: argparse.Namespace) -> int:
    from kfp import compiler

    with _images_under(args.registry):
        from pipelines.pretrain import build, build_evaluation

        settings = ClusterSettings.from_flags(flag_values(args, "cluster")).for_cluster()
        pipeline = build_evaluation(settings) if args.pipeline == "evaluate" else build(settings)
        with tempfile.TemporaryDirectory() as tmp:  # the compiler picks the format from the file name's suffix
            compiled = Path(tmp) / "pipeline.yaml"
            compiler.Compiler().compile(pipeline, str(compiled))
            atomic_write(args.output, lambda out: shutil.copyfile(compiled, out))
    print(f"wrote {args.output}")
    _warn_unregistered(str(args.output))
    return 0


@contextlib.contextmanager
def _images_under(registry: str | None) -> Iterator[None]:
    """The components built with their images named under ``registry`` (they read the names when imported, so
    they are imported again), and as they were afterwards."""
    if not registry:
        yield
        return
    from components.image_names import image_names

    names = image_names(registry)
    named = [name for name in names if os.environ.get(name)]
    if named:  # before, --registry replaced them without a word
        raise ConfigError(f"--registry {registry} and {' and '.join(named)} both name the steps' images: give one")
    before = {name: os.environ.get(name) for name in names}

    def reimport() -> None:
        for module in ("components.images", "components.steps", "pipelines.pretrain"):
            if module in sys.modules:
                importlib.reload(sys.modules[module])

    os.environ.update(names)
    reimport()
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        reimport()


def _warn_unregistered(package: str) -> None:
    from pipelines.client import unregistered_images

    images = unregistered_images(package)
    if images:
        print(f"warning: {package}'s image(s) {', '.join(images)} name no registry: a cluster's nodes pull them from "
              "Docker Hub unless they were loaded onto them; compile with --registry REGISTRY (or set "
              "CLOOB_IMAGE_CPU / CLOOB_IMAGE_CUDA)", file=sys.stderr)


DEFAULT_PACKAGE = Path("pipelines/compiled/pretrain_evaluate.yaml")


def _inputs(args: argparse.Namespace) -> int:
    from pipelines.copied_inputs import read_spec, step_inputs, table

    print(table(step_inputs(read_spec(_package(args.package)))))
    return 0


def _package(path: Path) -> str:
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; write it first with "
                                f"`python -m pipelines compile --output {path}`")
    return str(path)


def _parameters(args: argparse.Namespace) -> dict[str, str]:
    """The run's parameters for a cluster: checked against the package they go with, before anything is sent."""
    from pipelines import client

    package = _package(args.package)
    shards_uri = args.shards_uri
    if args.dvc_path:
        shards_uri = client.dvc_data_url(args.dvc_path, repo=args.dvc_repo, rev=args.dvc_rev, remote=args.dvc_remote)
        print(f"importing {args.dvc_path}@{args.dvc_rev or 'workspace'}: {shards_uri}")
    parameters = client.run_parameters(args.params, args.set, shards_uri, package=package)
    _warn_unregistered(package)
    return parameters


def _submit(args: argparse.Namespace) -> int:
    from pipelines import client

    parameters, package = _parameters(args), _package(args.package)  # both checked before anything is sent
    api = client.connect(args.host, args.namespace, args.timeout)
    submitted = client.submit(api, package, experiment=args.experiment, run_name=args.run_name,
                              parameters=parameters, namespace=args.namespace,
                              enable_caching=False if args.no_cache else None,
                              service_account=args.service_account)
    print(f"submitted run {submitted.run_id} in experiment {args.experiment} ({submitted.experiment_id})")
    return 0


def _schedule(args: argparse.Namespace) -> int:
    from pipelines import client

    if args.action == "create":
        check_cron(args.cron)
        parameters, package = _parameters(args), _package(args.package)
        client.check_schedule_fits(package, args.cron)
    api = client.connect(args.host, args.namespace, args.timeout)
    if args.action == "create":
        recurring = client.schedule(api, package, experiment=args.experiment, name=args.name,
                                    cron=args.cron, parameters=parameters, namespace=args.namespace,
                                    enabled=not args.paused, replace=args.replace,
                                    service_account=args.service_account)
        print(f"created recurring run {recurring} '{args.name}' ({args.cron}, one at a time, no catch-up)"
              + (", replacing any earlier one of that name" if args.replace else ""))
    elif args.action == "list":
        for entry in client.list_schedules(api, args.experiment, args.namespace):
            print(f"{entry['id']}  {entry['name']}  {entry['cron']}  {entry['status']}")
    else:
        client.delete_schedule(api, args.id)
        print(f"deleted recurring run {args.id}")
    return 0


def _preflight(args: argparse.Namespace) -> int:
    from cloob_core.config import load_config
    from cloob_core.ops.preflight import preflight
    from cloob_core.storage import join
    from pipelines import client

    package = _package(args.package)
    settings = client.job_settings(package)  # refused in one line when this version cannot run them
    if settings is None:
        print(f"preflight: {package} trains in one KFP step, so it submits no training job to check")
        return 0
    config = load_config(args.params, list(args.set))
    shards = args.shards_uri or join(settings.shards_store, "preflight")
    for verdict in preflight(settings, config, shards, namespace=args.namespace):
        print(f"preflight: {verdict.line()}")
    return 0


def _run_local(args: argparse.Namespace) -> int:
    from pipelines import client, local_run
    from pipelines.pretrain import build, build_evaluation

    root = args.root.resolve()
    # kfp.local gives a step no GPU: the training step runs on this machine's CPU unless --gpus says otherwise
    settings = ClusterSettings.from_flags({"shards_store": str(root / "shards"), "job_workdir": str(root / "jobs"),
                                           "gpus": 0, **flag_values(args, "cluster")})
    pipeline = build_evaluation(settings) if args.pipeline == "evaluate" else build(settings)
    overrides = list(args.set)
    if not any(item.split("=", 1)[0].strip() == "promote.store" for item in overrides):
        # a local run promotes into its own registry, never into the DVC pipeline's (params.yaml's promote.store)
        overrides.append(f"promote.store={root / 'registry'}")
    parameters = client.run_parameters(args.params, overrides)
    container = None
    if args.runner == "docker":
        container = local_run.StepContainer.sharing(settings.shards_store, settings.job_workdir)
    log = root / "run-local.log"
    with contextlib.nullcontext() if args.show_logs else local_run.output_to(log):
        run = local_run.run_pipeline(pipeline, parameters, root, args.runner, container)
    print(f"run {run.name} finished ({args.runner}); its outputs: {run}"
          + ("" if args.show_logs else f"; the steps' output: {log}"))
    suite = local_run.final_metrics(run).get("suite", {})  # the model trained, or production re-evaluated
    for name, value in sorted(suite.items()):
        print(f"  suite.{name:<24} {100 * value:.2f}%")
    return 0


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--package", type=Path, default=DEFAULT_PACKAGE, help=f"compiled pipeline ({DEFAULT_PACKAGE})")
    parser.add_argument("--params", default="params.yaml", help="configuration of the run (default params.yaml)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one value (repeatable); validated before anything is sent")
    data = parser.add_mutually_exclusive_group()
    data.add_argument("--shards-uri", help="s3:// folder of shards, for a pipeline compiled with --data import")
    data.add_argument("--dvc-path", help="or a DVC-tracked shards folder (e.g. data/shards) on a worktree S3 remote, "
                      "resolved to its URI")
    parser.add_argument("--dvc-rev", help="git revision of --dvc-path (tag, branch, commit; default: workspace)")
    parser.add_argument("--dvc-repo", help="repository of --dvc-path (default: this one)")
    parser.add_argument("--dvc-remote", help="DVC remote of --dvc-path (default: the default remote)")
    parser.add_argument("--service-account", help="Kubernetes service account the run's steps run as (default: "
                        "the endpoint's, e.g. pipeline-runner / default-editor); it needs infra/k8s/base/rbac.yaml "
                        "for a multi-node run")


def _add_endpoint_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", required=True, help="KFP API endpoint, e.g. http://ml-pipeline-ui.kubeflow:80")
    parser.add_argument("--namespace", help="Kubeflow profile namespace (multi-user clusters)")
    parser.add_argument("--experiment", default="cloob", help="experiment name (created if missing; default cloob)")
    parser.add_argument("--timeout", type=_positive_seconds, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                        help=f"deadline for each call to the endpoint (default {DEFAULT_TIMEOUT_S:g})")


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipelines", description=" ".join(__doc__.split()))
    parser.add_argument("-v", "--verbose", action="store_true", help="show the traceback of a failure")
    sub = parser.add_subparsers(dest="command", required=True)
    comp = sub.add_parser("compile", help="write the pretraining-and-evaluation pipeline as KFP YAML")
    comp.add_argument("--pipeline", choices=["pretrain", "evaluate"], default="pretrain",
                      help="pretrain: data -> training -> evaluation -> promotion (default); evaluate: re-evaluate "
                      "the production model")
    comp.add_argument("--output", type=Path, default=DEFAULT_PACKAGE)
    comp.add_argument("--registry", metavar="REGISTRY", help="name the steps' images under this registry (e.g. "
                      "ghcr.io/acme: ghcr.io/acme/cloob-pipelines:VERSION-COMMIT-cpu), where infra/images/build.sh "
                      "pushed them; default: CLOOB_IMAGE_CPU / CLOOB_IMAGE_CUDA, else no registry (a warning); not "
                      "both")
    add_model_flags(comp, ClusterSettings, "cluster", "cluster settings (cloob_core.config.cluster.ClusterSettings)",
                    skip=("image",))
    comp.set_defaults(func=_compile)

    inputs = sub.add_parser("inputs", help="what each step of a compiled pipeline gets: the input artifacts KFP "
                            "copies into its pod, and the parameters passed by value")
    inputs.add_argument("--package", type=Path, default=DEFAULT_PACKAGE, help=f"compiled pipeline ({DEFAULT_PACKAGE})")
    inputs.set_defaults(func=_inputs)

    here = sub.add_parser("run-local", help="run a pipeline on this machine with kfp.local: each step in its image "
                          "(--runner docker, as the cluster runs it) or as a subprocess of this environment")
    here.add_argument("--pipeline", choices=["pretrain", "evaluate"], default="pretrain")
    here.add_argument("--runner", choices=["docker", "subprocess"], default="docker")
    here.add_argument("--root", type=Path, default=Path("local_outputs"),
                      help="pipeline root (default local_outputs); the shards are built in ROOT/shards unless "
                      "--shards-store names another folder")
    here.add_argument("--show-logs", action="store_true", help="print kfp.local's output (each step's executor "
                      "input and logs) here rather than into ROOT/run-local.log")
    here.add_argument("--params", default="params.yaml", help="configuration of the run (default params.yaml)")
    here.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                      help="override one value (repeatable); promote.store defaults to ROOT/registry, apart from the "
                      "DVC pipeline's")
    add_model_flags(here, ClusterSettings, "cluster", "cluster settings (cloob_core.config.cluster.ClusterSettings)",
                    skip=("image",))
    here.set_defaults(func=_run_local)

    check = sub.add_parser("preflight", help="ask the cluster of the kubeconfig (KUBECONFIG, ~/.kube/config) what "
                           "it says of the training job a compiled pipeline would submit: a dry run (dryRun=All, "
                           "strict field validation) through the CRD's schema and every admission webhook, which "
                           "keeps nothing; exit status 1 when the cluster refuses it")
    check.add_argument("--package", type=Path, default=DEFAULT_PACKAGE, help=f"compiled pipeline ({DEFAULT_PACKAGE})")
    check.add_argument("--params", default="params.yaml", help="configuration of the run (default params.yaml)")
    check.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override one value (repeatable)")
    check.add_argument("--shards-uri", help="the s3:// shards the run trains on (default: under the package's "
                       "shards_store)")
    check.add_argument("--namespace", help="namespace the run's steps run in (default: the package's job_namespace, "
                       "else the kubeconfig context's)")
    check.set_defaults(func=_preflight)

    run = sub.add_parser("submit", help="start one run of a compiled pipeline")
    _add_endpoint_options(run)
    _add_run_options(run)
    run.add_argument("--run-name", required=True)
    run.add_argument("--no-cache", action="store_true", help="run every task, cached results or not")
    run.set_defaults(func=_submit)

    sched = sub.add_parser("schedule", help="recurring runs: create, list, delete")
    actions = sched.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="a recurring run (max_concurrency 1, no catch-up)")
    _add_endpoint_options(create)
    _add_run_options(create)
    create.add_argument("--name", required=True, help="recurring run name, e.g. nightly-retrain")
    create.add_argument("--cron", required=True, help="six-field cron, seconds first: '0 0 3 * * *' = 03:00 daily")
    create.add_argument("--paused", action="store_true", help="create it disabled")
    create.add_argument("--replace", action="store_true", help="replace the experiment's recurring run of this "
                        "name (without it, a second of the same name is refused: the two would overlap)")
    listing = actions.add_parser("list", help="the experiment's recurring runs")
    _add_endpoint_options(listing)
    delete = actions.add_parser("delete", help="delete a recurring run by id")
    _add_endpoint_options(delete)
    delete.add_argument("id")
    sched.set_defaults(func=_schedule)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except StageError as err:  # a bad configuration (nothing was sent), an endpoint that failed
        return fail(err, args.verbose, err.exit_code, program="pipelines")
    except KeyboardInterrupt as err:
        return fail(err, args.verbose, 130, "interrupted", program="pipelines")
    except Exception as err:
        return fail(err, args.verbose, 2 if user_facing(err) else 1, program="pipelines")


if __name__ == "__main__":
    sys.exit(main())
