"""One declaration of the pipelines' graphs (cloob_core/ops/graph.py) and of each step's pod (cloob_core/ops/pods.py):
the compiled Kubeflow pipeline has exactly the declared steps, order and fan-outs, and each step's compiled pod
carries what its description says, for one node and two, with GPUs and without, curation on and off, shards
acquired and imported, and the re-evaluation pipeline."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from graphs import reduced

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # components/ and pipelines/ run from the repository root, uninstalled

from cloob_core.config.cluster import ClusterSettings  # noqa: E402
from cloob_core.ops import graph, pods  # noqa: E402

SETTINGS = {
    "one node, CPU": ({"gpus": 0}, "pretrain"),
    "one node, 4 GPUs, curation": ({"gpus": 4, "curation": True, "kueue_queue": "team-a",
                                    "node_selector": {"pool": "h100"}, "cpu_node_selector": {"pool": "cpu"},
                                    "cpu_tolerations": [{"key": "cpu", "operator": "Exists"}]}, "pretrain"),
    "two nodes, curation, imported": ({"nodes": 2, "gpus": 8, "job_workdir": "s3://b/jobs", "curation": True,
                                       "data": "import", "pod_labels": {"team": "ml"},
                                       "image_pull_secrets": ["registry"]}, "pretrain"),
    "two nodes, no curation, CPU features": ({"nodes": 2, "gpus": 8, "job_workdir": "s3://b/jobs",
                                              "eval_gpus": 0, "spill_disk": ""}, "pretrain"),
    "re-evaluation": ({"gpus": 1}, "evaluate"),
}


def _compile(tmp_path: Path, values: dict, pipeline: str) -> dict:
    from kfp import compiler

    from pipelines.pretrain import build, build_evaluation

    settings = ClusterSettings(**values)
    path = tmp_path / "pipeline.yaml"
    compiler.Compiler().compile(build_evaluation(settings) if pipeline == "evaluate" else build(settings), str(path))
    return {"pipeline": list(yaml.safe_load_all(path.read_text()))}


def _kfp_graph(spec: dict) -> tuple[dict[str, set[str]], dict[str, str | None], set[str]]:
    """The compiled pipeline's happens-before relation over its steps (a dependency on a loop is one on every step
    inside it; a step inside a loop follows what the loop follows), reduced; the step each one fans out over; the
    exit handler's steps."""
    components = spec["components"]
    before: dict[str, set[str]] = {}
    maps: dict[str, str | None] = {}
    at_end: set[str] = set()

    def leaves(tasks: dict, name: str) -> set[str]:
        task = tasks[name]
        inner = components[task["componentRef"]["name"]].get("dag")
        if inner is None:
            return {name.replace("-", "_")}
        return set().union(*(leaves(inner["tasks"], n) for n in inner["tasks"]))

    def walk(tasks: dict, outer: set[str], loop_items: str | None) -> None:
        for name, task in tasks.items():
            deps = set(outer)
            for dep in task.get("dependentTasks", []):
                deps |= leaves(tasks, dep)
            inner = components[task["componentRef"]["name"]].get("dag")
            if inner is not None:
                items = loop_items
                if "parameterIterator" in task:
                    source = task["parameterIterator"]["items"]["inputParameter"]
                    parameter = task["inputs"]["parameters"][source]
                    producer = parameter.get("taskOutputParameter", {}).get("producerTask")
                    items = producer.replace("-", "_") if producer else loop_items
                walk(inner["tasks"], deps, items)
                continue
            step = name.replace("-", "_")
            if task.get("triggerPolicy", {}).get("strategy") == "ALL_UPSTREAM_TASKS_COMPLETED":
                at_end.add(step)
            before[step] = deps
            maps[step] = loop_items

    walk(spec["root"]["dag"]["tasks"], set(), None)
    return reduced(before), maps, at_end


@pytest.mark.parametrize("case", SETTINGS)
def test_the_compiled_pipeline_has_the_declared_steps_order_and_fan_outs(tmp_path, case):
    values, pipeline = SETTINGS[case]
    spec = _compile(tmp_path, values, pipeline)["pipeline"][0]
    declared = graph.graph(pipeline, ClusterSettings(**values))
    edges, maps, at_end = _kfp_graph(spec)
    ordinary = [step for step in declared if not step.at_end]
    assert set(edges) - at_end == {step.name for step in ordinary}
    assert {step.name: set(step.after) for step in ordinary} == {step: edges[step] for step in edges
                                                                  if step not in at_end}
    # fan-outs: the loop's items come from the declared step (a nested loop's from the enclosing one's step)
    for step in ordinary:
        if step.maps_over:
            assert maps[step.name] in (step.maps_over, *[s.maps_over for s in ordinary if s.name == step.maps_over])
        else:
            assert maps[step.name] is None, step.name
    assert at_end == {step.name for step in declared if step.at_end}


def _retry_policies(spec: dict) -> dict[str, dict]:
    """Each step's compiled retry policy, from the root DAG and the loops' DAGs."""
    policies = {}
    for dag in [spec["root"]["dag"], *(c["dag"] for c in spec["components"].values() if "dag" in c)]:
        for name, task in dag["tasks"].items():
            if "retryPolicy" in task:
                policies[name.replace("-", "_")] = task["retryPolicy"]
    return policies


def _platform(document: list, step: str) -> dict:
    executors = document[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    return executors.get(f"exec-{step.replace('_', '-')}", {})


def _container(document: list, step: str) -> dict:
    return document[0]["deploymentSpec"]["executors"][f"exec-{step.replace('_', '-')}"]["container"]


@pytest.mark.parametrize("case", SETTINGS)
def test_each_compiled_step_carries_its_described_pod(tmp_path, case):
    values, pipeline = SETTINGS[case]
    settings = ClusterSettings(**values)
    document = _compile(tmp_path, values, pipeline)["pipeline"]
    for step in graph.graph(pipeline, settings):
        pod = pods.pod(step.name, settings)
        platform, container = _platform(document, step.name), _container(document, step.name)
        assert container["image"].endswith(f"-{pod.image}"), step.name
        resources = container.get("resources", {})
        assert resources.get("resourceCpuRequest") == pod.cpu and resources.get("resourceMemoryRequest") == \
            pod.memory, step.name
        assert resources.get("resourceMemoryLimit") == pod.memory_limit, step.name
        accelerator = resources.get("accelerator", {})
        assert int(accelerator.get("resourceCount", 0)) == pod.gpus, step.name
        assert platform.get("nodeSelector", {}).get("labels", {}) == pod.node_selector, step.name
        assert platform.get("tolerations", []) == pod.tolerations, step.name
        affinity = [a["nodeAffinityJson"]["runtimeValue"]["constant"] for a in platform.get("nodeAffinity", [])]
        assert affinity == ([pod.node_affinity] if pod.node_affinity else []), step.name
        env = {e["name"]: e["value"] for e in container.get("env", [])}
        assert env == pod.env, step.name
        secrets = {(s["secretName"], s.get("optional", False), tuple(k["secretKey"] for k in s["keyToEnv"]))
                   for s in platform.get("secretAsEnv", [])}
        assert secrets == {(s.secret, s.optional, s.keys) for s in pod.secret_env}, step.name
        metadata = platform.get("podMetadata", {})
        assert metadata.get("labels", {}) == pod.labels and metadata.get("annotations", {}) == pod.annotations, \
            step.name
        assert platform["securityContext"] == {"runAsUser": str(pod.run_as), "runAsGroup": str(pod.run_as),
                                               "runAsNonRoot": True}, step.name
        volumes = {v["volumeName"]: v for v in platform.get("genericEphemeralVolume", [])}
        assert ("spill" in volumes) == bool(pod.spill), step.name
        shm = {v["volumeName"]: v for v in platform.get("emptyDirMounts", [])}
        assert ("dshm" in shm) == bool(pod.shm), step.name
        retry = _retry_policies(document[0]).get(step.name)
        assert retry == ({"maxRetryCount": pod.retry.count, "backoffDuration": f"{pod.retry.backoff_s}s",
                          "backoffFactor": pod.retry.factor, "backoffMaxDuration": "3600s"}
                         if pod.retry else None), step.name
        if pod.timeout_s:
            assert platform["activeDeadlineSeconds"] == str(pod.timeout_s), step.name
        else:
            assert "activeDeadlineSeconds" not in platform, step.name


def test_every_declared_step_has_a_pod_and_an_unknown_one_is_refused():
    settings = ClusterSettings(nodes=2, gpus=8, job_workdir="s3://b/jobs", curation=True)
    names = {step.name for pipeline in ("pretrain", "evaluate") for step in graph.graph(pipeline, settings)}
    names |= {"train", "acquire"}
    for name in names:
        assert pods.pod(name, settings).run_as != 0
    with pytest.raises(KeyError, match="no pipeline step 'trian'"):
        pods.pod("trian", settings)


def test_the_declarations_import_without_torch_kfp_or_a_kubernetes_client():
    """Airflow parses its DAG files often and in its own environment, which has pydantic and yaml but no torch,
    kfp or the project's data stack: the graph and the pods must import there."""
    import subprocess

    probe = ("import sys; from cloob_core.ops import graph, pods; "
             "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'kfp', 'kubernetes', 'fsspec', "
             "'numpy', 'duckdb', 'PIL', 'boto3'}); print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
