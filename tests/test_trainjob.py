"""Multi-node training through the Training Operator: the PyTorchJob / TrainJob resources, the pods' command, and
the whole round trip (create -> pods train under torchrun -> result on S3 -> fetched) against a stand-in API
server on 127.0.0.1 whose "pods" are local processes, with a real S3-compatible server (moto) between them."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
import urllib.parse
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from cloob_core import storage
from cloob_core.config import CloobConfig, load_config
from cloob_core.config.cluster import ClusterSettings
from cloob_core.ops import airflow_run, kubeflow, launch, trainjob
from cloob_core.ops.trainjob import JobFailed

sys.path.insert(0, str(Path(__file__).resolve().parent))
import job_schemas
from json_api_server import JsonApiServer
from k8s_api_server import FakeTrainingCluster
from trained_weights import largest_difference

ODD_SHARDS = "s3://data/odd name/it's \" $HOME `ticks`"  # what a shell would break: it must reach the ranks as is


def job_config(shards: str = "s3://data/shards", workdir: str = "s3://jobs/prefix/run1") -> CloobConfig:
    return trainjob.job_config(load_config(overrides=["train.objective=infoloob"]), shards, workdir)


def settings(**changes) -> ClusterSettings:
    base = {"image": "registry.example/cloob:cuda", "job_workdir": "s3://jobs/prefix", "nodes": 3, "gpus": 8,
            "node_selector": {"pool": "h100"}}
    return ClusterSettings(**{**base, **changes})


def test_a_pytorchjob_has_a_master_workers_gpus_shm_and_secrets_by_reference(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "do-not-leak-me")
    config = job_config()
    body = trainjob.manifest(settings(), "cloob-train-run1", config, "s3://jobs/prefix/run1")
    assert body["apiVersion"] == "kubeflow.org/v1" and body["kind"] == "PyTorchJob"
    spec = body["spec"]
    assert spec["nprocPerNode"] == "8" and spec["runPolicy"]["backoffLimit"] == 3
    # an ended job's running pods stopped, its ended ones (and their logs) kept a day, then the job deleted; before,
    # cleanPodPolicy None and no TTL kept succeeded jobs for ever
    assert spec["runPolicy"]["cleanPodPolicy"] == "Running" and spec["runPolicy"]["ttlSecondsAfterFinished"] == 86400
    # exit codes 1-127 (the code's own failure) end the job; a kill (128 + signal) restarts the pod
    assert {replica["restartPolicy"] for replica in spec["pytorchReplicaSpecs"].values()} == {"ExitCode"}
    replicas = spec["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 2
    for role in ("Master", "Worker"):
        pod = replicas[role]["template"]["spec"]
        container = pod["containers"][0]
        assert container["name"] == "pytorch"  # the operator finds the training container by this name
        assert container["imagePullPolicy"] == "IfNotPresent"  # tags name one build
        assert container["resources"]["limits"] == {"nvidia.com/gpu": "8"}
        assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}} in pod["volumes"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        assert pod["nodeSelector"] == {"pool": "h100"} and pod["tolerations"][0]["key"] == "nvidia.com/gpu"
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]
                if "secretKeyRef" in e.get("valueFrom", {})}
        cores = {"name": "LOKY_MAX_CPU_COUNT", "valueFrom": {"resourceFieldRef": {"resource": "requests.cpu",
                                                                                "divisor": "1"}}}
        assert cores in container["env"]  # the thread budget follows the pod's CPU request
        assert set(refs) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"}
        assert all(ref["name"] == "cloob-s3" for ref in refs.values())
        assert {"name": "CLOOB_PARAMS", "value": launch.config_text(config)} in container["env"]
        assert replicas[role]["template"]["metadata"]["labels"]["app.kubernetes.io/part-of"] == "cloob-pipelines"
        assert container.get("ports") == ([{"name": "metrics", "containerPort": ClusterSettings().metrics_port}]
                                          if role == "Master" else None)  # rank 0 alone serves metrics
    assert "do-not-leak-me" not in json.dumps(body)


def test_one_node_has_no_workers_and_a_cpu_job_asks_for_no_gpu():
    body = trainjob.manifest(settings(nodes=1, gpus=0), "cloob-train-x", job_config(), "s3://w")
    assert set(body["spec"]["pytorchReplicaSpecs"]) == {"Master"} and body["spec"]["nprocPerNode"] == "1"
    assert "limits" not in body["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0][
        "resources"]


def pod_settings(body: dict) -> list[dict]:
    """The pod-spec fields a body sets for its pods, whatever its API: a PyTorchJob's templates, Trainer v2.1's
    podTemplateOverrides, v2.3's runtimePatches."""
    spec = body["spec"]
    if "pytorchReplicaSpecs" in spec:
        return [replica["template"]["spec"] for replica in spec["pytorchReplicaSpecs"].values()]
    if "podTemplateOverrides" in spec:
        return [override["spec"] for override in spec["podTemplateOverrides"]]
    return [job["template"]["spec"]["template"]["spec"] for patch in spec["runtimePatches"]
            for job in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]]


@pytest.mark.parametrize("release", ["v2.1", "v2.2", "v2.3"])
def test_a_trainjob_uses_the_torch_runtime_with_nodes_and_the_pods_settings_its_release_takes(release):
    body = trainjob.manifest(settings(job_kind="trainjob", trainer_release=release, job_namespace="team-a"),
                             "cloob-train-run1", job_config(), "s3://w")
    assert body["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and body["kind"] == "TrainJob"
    assert body["metadata"]["namespace"] == "team-a"
    spec = body["spec"]
    assert spec["runtimeRef"] == {"name": "torch-distributed", "apiGroup": "trainer.kubeflow.org",
                                  "kind": "ClusterTrainingRuntime"}
    assert spec["trainer"]["numNodes"] == 3 and spec["trainer"]["numProcPerNode"] == 8
    assert spec["trainer"]["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": "8"}
    (pod,) = pod_settings(body)
    assert pod["nodeSelector"] == {"pool": "h100"}
    assert pod["containers"][0]["name"] == "node"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]
    if release == "v2.1":  # v2.1 has neither: the watcher's deadline is the only one, the runtime's context
        assert "activeDeadlineSeconds" not in spec and "securityContext" not in pod
        assert spec["podTemplateOverrides"][0]["targetJobs"] == [{"name": "node"}]
    else:
        assert spec["activeDeadlineSeconds"] == 7 * 24 * 3600 and pod["securityContext"]["runAsNonRoot"]
        assert spec["runtimePatches"][0]["manager"] == trainjob.PATCH_MANAGER == "cloob-pipelines.io/train"


SPOT = {"key": "spot", "operator": "Equal", "value": "true", "effect": "NoExecute", "tolerationSeconds": 600}
ZONE = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [
    {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["us-east-1a"]}]}]}}
BODY_SETTINGS = [  # each job kind and release, with every setting that changes a body
    {"job_kind": "pytorchjob", "nodes": 1, "gpus": 0},
    {"job_kind": "pytorchjob", "host_network": True, "rdma_resources": {"rdma/hca": "1"}, "efa_devices": 4,
     "image_pull_secrets": ["regcred"], "service_account": "cloob-train", "job_namespace": "team-a",
     "priority_class": "high", "scheduler_name": "volcano", "gang_scheduling": True, "kueue_queue": "gpus"},
    *({"job_kind": "trainjob", "trainer_release": release, "efa_devices": 4, "image_pull_secrets": ["regcred"],
       "service_account": "cloob-train", "gpu_taint": "", "s3_secret": "", "pod_labels": {"team": "vision"},
       "pod_annotations": {"example.com/cost-centre": "ml"}, "kueue_queue": "gpus", "tolerations": [SPOT],
       "node_affinity": ZONE} for release in ("v2.1", "v2.2", "v2.3")),
    *({"job_kind": "trainjob", "trainer_release": release, "nodes": 2, "gpus": 0} for release in ("v2.1", "v2.3")),
]
# the operator releases whose CRD each body must pass (tests/crds): a PyTorchJob's both, a TrainJob's its own
CRD_RELEASES = {("pytorchjob", None): job_schemas.RELEASES["pytorchjob"], ("trainjob", "v2.1"): ("v2.1.0",),
                ("trainjob", "v2.2"): ("v2.2.1", "v2.3.0"), ("trainjob", "v2.3"): ("v2.2.1", "v2.3.0")}


@pytest.mark.parametrize("changes", BODY_SETTINGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items())[:60])
def test_every_job_body_passes_its_operators_real_crd_with_nothing_to_prune(changes):
    """Against the CRDs the operators ship (Training Operator v1.8.1 and v1.9.3; Trainer v2.1.0, v2.2.1, v2.3.0),
    with unknown fields an error as strict field validation makes them (before: a TrainJob's securityContext,
    hostNetwork and dnsPolicy under podTemplateOverrides, and a deadline v2.1 does not have)."""
    job = settings(**changes)
    body = trainjob.manifest(job, "cloob-train-v", job_config(), "s3://w")
    releases = CRD_RELEASES[(job.job_kind, job.trainer_release if job.job_kind == "trainjob" else None)]
    for release in releases:
        assert job_schemas.errors(job.job_kind, release, body) == [], release
        assert trainjob.missing_fields(body, job_schemas.pruned(job.job_kind, release, body)) == []
    broken = json.loads(json.dumps(body))
    pod_settings(broken)[0]["containers"][0]["volumeMount"] = []  # a misspelling
    assert any(path.endswith("containers[0].volumeMount")
               for path in job_schemas.unknown_fields(job.job_kind, releases[0], broken))
    if job.job_kind == "trainjob":  # each release's body is refused by the others' CRDs
        for other in set(job_schemas.RELEASES["trainjob"]) - set(releases):
            assert job_schemas.unknown_fields("trainjob", other, body), other


def test_a_trainjob_cannot_ask_for_what_only_its_runtime_sets():
    for name, value in (("host_network", True), ("priority_class", "high"), ("scheduler_name", "volcano")):
        with pytest.raises(ValueError, match=f"{name} with job_kind trainjob: a TrainJob cannot set them"):
            settings(job_kind="trainjob", **{name: value})




@pytest.mark.parametrize("kind, release", [("pytorchjob", "v2.3"), ("trainjob", "v2.1"), ("trainjob", "v2.3")])
def test_job_pods_take_the_scheduling_controls_their_api_has(kind, release):
    """Before: one NoSchedule toleration and nothing else. Now: more tolerations, node affinity and a Kueue queue
    on every kind; priority class, scheduler and a gang on a PyTorchJob (a TrainJob's runtime sets those)."""
    extra = {"priority_class": "training-high", "scheduler_name": "volcano", "gang_scheduling": True} \
        if kind == "pytorchjob" else {}
    job = settings(job_kind=kind, trainer_release=release, tolerations=[SPOT], node_affinity=ZONE,
                   kueue_queue="team-a-gpus", **extra)
    body = trainjob.manifest(job, "cloob-train-s", job_config(), "s3://w")
    assert job_schemas.errors(kind, job_schemas.crd_release(kind, release), body) == []
    assert body["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a-gpus"
    for pod in pod_settings(body):
        assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}, SPOT]
        assert pod["affinity"] == {"nodeAffinity": ZONE}
        if kind == "pytorchjob":
            assert pod["priorityClassName"] == "training-high" and pod["schedulerName"] == "volcano"
    if kind == "pytorchjob":
        assert body["spec"]["runPolicy"]["schedulingPolicy"] == {"minAvailable": 3, "priorityClass": "training-high"}
    with pytest.raises(ValueError, match="gang_scheduling needs scheduler_name"):
        settings(gang_scheduling=True)
    with pytest.raises(ValueError, match="toleration operator 'Maybe'"):
        settings(tolerations=[{"key": "a", "operator": "Maybe"}])
    with pytest.raises(ValueError, match="not NodeAffinity fields"):
        settings(node_affinity={"nodeSelectorTerms": []})


@pytest.mark.parametrize("sent, served", [("v2.3", "v2.1.0"), ("v2.1", "v2.3.0"), ("v2.1", "v2.2.1")])
def test_a_body_for_another_trainer_release_is_refused_in_one_line_and_not_tried_again(sent, served, tmp_path,
                                                                                       monkeypatch):
    """The cluster runs another Trainer release than the body's. Every create goes with strict field validation,
    so the API server refuses it naming the fields its CRD lacks (before: it pruned the pods' settings in silence),
    and the refusal is permanent: the same body would be refused again."""
    with FakeTrainingCluster(run_pods=False, releases={"trainjobs": served}) as cluster:
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig(tmp_path / "kubeconfig")))
        job = settings(job_kind="trainjob", trainer_release=sent, nodes=2, gpus=0, job_poll_s=0.05,
                       job_namespace="team-a")
        lost = "runtimePatches" if sent == "v2.3" else "podTemplateOverrides"
        with pytest.raises(JobFailed, match=rf'^the cluster refused TrainJob team-a/cloob-train-pruned \(HTTP 400\): '
                                            rf'TrainJob in version "v1alpha1" cannot be handled as a TrainJob: strict '
                                            rf'decoding error: (unknown field "spec\.\w+", )?unknown field '
                                            rf'"spec\.{lost}"') as refused:
            trainjob.run(trainjob.manifest(job, "cloob-train-pruned", job_config(), "s3://w"), job)
    assert refused.value.permanent
    (created,) = cluster.calls("POST", ".*")
    assert "fieldValidation=Strict" in created["query"]
    assert not cluster.objects and not cluster.calls("DELETE", ".*")  # nothing was created


def test_a_server_without_strict_validation_prunes_and_the_read_back_deletes_the_job(tmp_path, monkeypatch):
    """An API server before fieldValidation (or one that ignores it) prunes the unknown fields without a word: the
    watcher reads the job back, names what is missing and the setting to change, and deletes it rather than train
    without volumes or selectors."""
    with FakeTrainingCluster(run_pods=False, releases={"trainjobs": "v2.1.0"}, strict_validation=False) as cluster:
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig(tmp_path / "kubeconfig")))
        job = settings(job_kind="trainjob", nodes=2, gpus=0, job_poll_s=0.05, job_namespace="team-a")
        with pytest.raises(JobFailed, match=r"dropped \d field\(s\) the body set \(.*spec.runtimePatches.*\): its "
                                            r"TrainJob schema lacks them, so the job is deleted\. Is the cluster's "
                                            r"Kubeflow Trainer the release trainer_release names \(v2\.3\)\?"):
            trainjob.run(trainjob.manifest(job, "cloob-train-pruned", job_config(), "s3://w"), job)
    assert cluster.requests[-1]["method"] == "DELETE"


def test_trainers_admission_refuses_a_manager_that_is_not_a_domain_prefixed_path(tmp_path, monkeypatch, caplog):
    """Trainer v2.2 and v2.3 refuse every TrainJob whose runtime patch's manager is not a domain-prefixed path (its
    jobset plugin's IsDomainPrefixedPath): the watcher reported the webhook's 403 as a missing Role and tried three
    times. Now the manager is one, and a webhook's denial is said as the webhook's, once, and is permanent."""
    job = settings(job_kind="trainjob", nodes=2, gpus=0, job_poll_s=0.05, job_namespace="team-a", s3_secret="")
    body = trainjob.manifest(job, "cloob-train-adm", job_config(), "s3://w")
    old = json.loads(json.dumps(body))
    old["spec"]["runtimePatches"][0]["manager"] = "cloob-pipelines"  # the manager before
    for served in ("v2.2.1", "v2.3.0"):
        with FakeTrainingCluster(run_pods=False, releases={"trainjobs": served}) as cluster:
            monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig(tmp_path / "kubeconfig")))
            denial = (r'^the cluster refused TrainJob team-a/cloob-train-adm \(HTTP 403\): admission webhook '
                      r'"validator.trainjob.trainer.kubeflow.org" denied the request: spec.runtimePatches.manager: '
                      r'Invalid value: "cloob-pipelines": must be a domain-prefixed path')
            with caplog.at_level("WARNING", logger="cloob_core.ops.trainjob"), \
                    pytest.raises(JobFailed, match=denial) as denied:
                trainjob.run(old, job)
            assert denied.value.permanent and "lacks the Role" not in str(denied.value)
            assert len(cluster.calls("POST", ".*")) == 1 and "trying again" not in caplog.text
            stored = trainjob.create_job(_kubeconfig_apis()[0], body, "team-a", job)  # ours is admitted
            assert stored["spec"]["runtimePatches"][0]["manager"] == "cloob-pipelines.io/train"


def test_any_admission_denial_is_the_webhooks_line_and_rbac_is_the_roles(tmp_path, monkeypatch):
    """A policy engine's webhook (Kyverno, Gatekeeper) refusing the job is said with its message; RBAC's refusal
    names the Role; neither is tried again, and the training step records it as no retry's to change."""
    from cloob_core.ops import final_failure

    def policy(plural: str, body: dict) -> str | None:
        return "images must come from registry.example.com" if plural == "pytorchjobs" else None

    job = settings(nodes=2, gpus=0, job_poll_s=0.05, job_namespace="team-a", s3_secret="")
    with FakeTrainingCluster(run_pods=False, admission=policy) as cluster:
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig(tmp_path / "kubeconfig")))
        with pytest.raises(JobFailed, match=r'\(HTTP 403\): admission webhook "policy.example.com" denied the request: '
                                            r'images must come from registry.example.com$') as denied:
            trainjob.run(trainjob.manifest(job, "cloob-train-pol", job_config(), "s3://w"), job)
    assert final_failure.permanent(denied.value) and len(cluster.calls("POST", ".*")) == 1

    rbac = 'pytorchjobs.kubeflow.org is forbidden: User "system:serviceaccount:team-a:pipeline-runner" cannot ' \
           'create resource "pytorchjobs" in API group "kubeflow.org" in the namespace "team-a"'

    class Forbidden(_FlakyApi):
        def create_namespaced_custom_object(self, *args, **kwargs):
            raise _api_error(403, rbac)

    with pytest.raises(JobFailed, match=r"lacks the Role cloob-training-jobs .*: pytorchjobs.kubeflow.org is "
                                        r"forbidden: User") as forbidden:
        trainjob.run(trainjob.manifest(job, "cloob-train-x", job_config(), "s3://w"), job, api=Forbidden([]))
    assert forbidden.value.permanent


def test_the_preflight_dry_run_creates_nothing_and_says_what_the_cluster_said(tmp_path, monkeypatch):
    """``dryRun=All`` with strict validation: the API server runs its CRD's validation and the admission webhooks
    and keeps nothing; a refusal comes back as the cluster worded it."""
    job = settings(job_kind="trainjob", nodes=2, gpus=0, job_namespace="team-a", s3_secret="")
    body = trainjob.manifest(job, "cloob-train-dry", job_config(), "s3://w")
    with FakeTrainingCluster() as cluster:
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig(tmp_path / "kubeconfig")))
        stored = trainjob.create_job(_kubeconfig_apis()[0], body, "team-a", job, dry_run=True)
        assert stored["metadata"]["name"] == "cloob-train-dry" and not cluster.objects and not cluster.pods
        (sent,) = cluster.calls("POST", ".*")
        assert "dryRun=All" in sent["query"] and "fieldValidation=Strict" in sent["query"]
    with FakeTrainingCluster(releases={"trainjobs": "v2.1.0"}) as cluster:
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig(tmp_path / "kubeconfig")))
        with pytest.raises(trainjob.JobRefused, match=r'strict decoding error: unknown field '
                                                      r'"spec\.activeDeadlineSeconds"'):
            trainjob.create_job(_kubeconfig_apis()[0], body, "team-a", job, dry_run=True)


def test_the_pod_command_writes_the_validated_config_and_calls_torchrun_with_intact_arguments(tmp_path):
    """Run the pod's script with a stand-in `python` that records its argv: quoting must survive the shell, and
    the ranks read the job's configuration from the params file alone, with nothing to apply again."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open('argv.json', 'w'))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    config = job_config(ODD_SHARDS, "s3://w/n")
    body = trainjob.manifest(settings(nodes=2, gpus=4), "n", config, "s3://w/n")
    container = body["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}",
           "CLOOB_PARAMS": next(e["value"] for e in container["env"] if e["name"] == "CLOOB_PARAMS")}
    subprocess.run(container["command"], cwd=tmp_path, env=env, check=True)
    assert load_config(tmp_path / "params.yaml") == config
    assert config.train.shards == ODD_SHARDS and config.train.objective == "infoloob"
    assert config.train.checkpoint_sync == "s3://w/n/checkpoints"
    assert config.train.metrics_port == ClusterSettings().metrics_port
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[:5] == ["-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=4", "-m"]
    assert argv[argv.index("--params") + 1] == "params.yaml" and "--set" not in argv
    assert argv[argv.index("--resume") + 1] == "latest" and argv[argv.index("--publish") + 1] == "s3://w/n/output"


@pytest.mark.parametrize(("kind", "conditions", "expected"), [
    ("pytorchjob", [], None),
    ("pytorchjob", [{"type": "Created", "status": "True"}, {"type": "Running", "status": "True"}], None),
    ("pytorchjob", [{"type": "Running", "status": "False"}, {"type": "Succeeded", "status": "True"}], "succeeded"),
    ("pytorchjob", [{"type": "Running", "status": "True"}, {"type": "Failed", "status": "True"}], "failed"),
    ("pytorchjob", [{"type": "Restarting", "status": "True"}], None),
    ("trainjob", [{"type": "Complete", "status": "True"}], "succeeded"),
    ("trainjob", [{"type": "Succeeded", "status": "True"}], None),  # not a TrainJob condition
    ("trainjob", [{"type": "Failed", "status": "True", "message": "OOMKilled"}], "failed"),
])
def test_job_outcome_from_conditions(kind, conditions, expected):
    assert trainjob.outcome(kind, {"conditions": conditions})[0] == expected


def test_job_names_are_valid_dns_labels():
    for run_id in ("3f2a9c1e-6b7d-4e8f-9a0b-1c2d3e4f5a6b", "Run_With Odd/Chars" * 5, "-x-"):
        name = trainjob.job_name(run_id)
        assert len(name) <= 52 and name[0].isalpha() and name[-1].isalnum()
        assert set(name) <= set("abcdefghijklmnopqrstuvwxyz0123456789-")


def test_bad_job_settings_are_refused():
    with pytest.raises(ValueError, match="job_kind"):
        settings(job_kind="mpijob")
    with pytest.raises(ValueError, match="work folder"):
        settings(job_workdir="")
    assert ClusterSettings.from_json(settings().to_json()) == settings()


def test_a_job_on_shards_its_pods_cannot_reach_is_refused_before_any_pod_starts(tmp_path):
    from cloob_core.config import ConfigError

    with pytest.raises(ConfigError, match="its shards must be an s3:// prefix, not '/data/shards'"):
        kubeflow.train_multinode({}, "/data/shards", str(tmp_path / "model"), settings().to_json(), "run-1")
    # 3 nodes x 8 GPUs are 24 ranks: the default batch of 128 cannot be shared among them, nor 8 streams
    with pytest.raises(ConfigError, match=r"batch_size 128 must split into 24 rank\(s\)"):
        kubeflow.train_multinode({}, "s3://data/shards", str(tmp_path / "model"), settings().to_json(), "run-1")
    with pytest.raises(ConfigError, match=r"data_streams \(8\) must be a multiple of the number of ranks \(24\)"):
        kubeflow.train_multinode({"train": {"data_streams": 8, "batch_size": 192}}, "s3://data/shards",
                                 str(tmp_path / "model"), settings().to_json(), "run-1")


def _stub_python(folder: Path, body: str) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    fake = folder / "python"
    fake.write_text("#!/bin/sh\n" + body)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{folder}:{os.environ['PATH']}"}


def test_a_failed_job_keeps_its_pods_evidence_in_the_log_and_is_deleted(tmp_path, monkeypatch, caplog):
    """Before the delete, each pod's exit code, termination message and last log lines are copied into the step's
    log (before: a `kubectl logs` command for pods the delete had removed); exit codes 1-127 are the code's own
    failure, which another try would repeat."""
    # rank 1 fails first, as one rank does; rank 0 is still running when the job fails
    stub = _stub_python(tmp_path / "bin", 'echo "rank $PET_NODE_RANK: step 7 loss nan"\n'
                                          '[ "$PET_NODE_RANK" = 0 ] && sleep 1\nexit 3\n')
    with FakeTrainingCluster(extra_env=stub) as cluster:
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig(tmp_path / "kubeconfig")))
        job = settings(nodes=2, gpus=0, job_namespace="team-a", job_poll_s=0.2, s3_secret="")
        with caplog.at_level("INFO", logger="cloob_core.ops.trainjob"), \
                pytest.raises(JobFailed, match=r"failed: Failed: PodFailed exit codes .*; its pods exited with "
                                               r"\[3\]") as failed:
            trainjob.run(trainjob.manifest(job, "cloob-train-f", job_config(), "s3://w"), job)
    assert failed.value.permanent
    methods = [(r["method"], r["path"]) for r in cluster.requests]
    assert methods[0] == ("POST", "/apis/kubeflow.org/v1/namespaces/team-a/pytorchjobs")
    assert methods[-1] == ("DELETE", "/apis/kubeflow.org/v1/namespaces/team-a/pytorchjobs/cloob-train-f")
    logs = [path for method, path in methods if path.endswith("/log")]
    assert logs == ["/api/v1/namespaces/team-a/pods/cloob-train-f-master-0/log",
                    "/api/v1/namespaces/team-a/pods/cloob-train-f-worker-0/log"]
    listed = cluster.calls("GET", "/api/v1/namespaces/team-a/pods")[-1]
    assert "training.kubeflow.org%2Fjob-name%3Dcloob-train-f" in listed["query"]
    text = caplog.text
    assert "pod cloob-train-f-worker-0, container pytorch: exit code 3 (Error): exited with 3" in text
    assert "pod cloob-train-f-master-0, container pytorch: Running" in text
    assert "cloob-train-f-master-0 | rank 0: step 7 loss nan" in text
    assert "cloob-train-f-worker-0 | rank 1: step 7 loss nan" in text
    assert cluster.requests[0]["authorization"] == "Bearer not-a-secret"  # the kubeconfig's credentials


def test_a_job_killed_by_a_signal_may_be_retried_and_a_kept_one_is_not_deleted(tmp_path, monkeypatch):
    """Exit code 128 + a signal (the OOM killer's SIGKILL, a preemption) is no failure of the code: a retry may
    get past it. With job_keep_failed the failed job stays for inspection."""
    with FakeTrainingCluster(extra_env=_stub_python(tmp_path / "bin", "kill -9 $$\n")) as cluster:
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig(tmp_path / "kubeconfig")))
        job = settings(nodes=2, gpus=0, job_namespace="team-a", job_poll_s=0.1, s3_secret="", job_keep_failed=True)
        with pytest.raises(JobFailed, match=r"its pods exited with \[137\]") as failed:
            trainjob.run(trainjob.manifest(job, "cloob-train-k", job_config(), "s3://w"), job)
    assert not failed.value.permanent
    assert not cluster.calls("DELETE", ".*") and ("team-a", "pytorchjobs", "cloob-train-k") in cluster.objects


def test_a_permanent_failure_is_recorded_and_the_steps_retry_ends_at_once(tmp_path):
    """KFP retries a step on any failure: a configuration error or a diverged run was tried 4 times, on several
    nodes up to 16. The first try records it in the run's folder; a retry fails in one line without training."""
    from cloob_core.ops import final_failure

    folder = str(tmp_path / "jobs" / "cloob-train-r1")
    bad = {"train": {"batch_size": 0}}
    with pytest.raises(Exception, match="batch_size") as first:
        kubeflow.train(bad, str(tmp_path / "shards"), str(tmp_path / "model"), run_folder=folder)
    assert final_failure.permanent(first.value)
    with pytest.raises(final_failure.FailedBefore, match=r"an earlier try of this run's training failed in a way "
                                                          r"a retry cannot change, so it is not tried again: "
                                                          r".*batch_size"):
        kubeflow.train({}, str(tmp_path / "shards"), str(tmp_path / "model"), run_folder=folder)
    # a failure a retry may get past is not recorded: the next try runs
    other = str(tmp_path / "jobs" / "cloob-train-r2")
    with pytest.raises(Exception) as unreadable:
        kubeflow.train({"train": {"steps": 1}}, str(tmp_path / "no-shards"), str(tmp_path / "m2"), run_folder=other)
    assert not final_failure.permanent(unreadable.value)
    assert not (tmp_path / "jobs" / "cloob-train-r2" / final_failure.FAILURE_FILE).exists()
    # on several nodes: a job whose pods exited 1-127 is recorded the same way, before any job is created again
    assert final_failure.permanent(_failed_job(permanent=True)) and not final_failure.permanent(_failed_job(False))


def _failed_job(permanent: bool) -> JobFailed:
    err = JobFailed("failed")
    err.permanent = permanent
    return err


def test_a_job_past_its_time_limit_is_deleted_and_its_pods_stopped(tmp_path, monkeypatch):
    with FakeTrainingCluster(extra_env=_stub_python(tmp_path / "bin", "sleep 60\n")) as cluster:
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig(tmp_path / "kubeconfig", namespace="ns-b")))
        job = settings(job_kind="trainjob", nodes=2, gpus=0, job_timeout_s=1.0, job_poll_s=0.1, s3_secret="")
        with pytest.raises(JobFailed, match="did not finish in 1 s"):
            trainjob.run(trainjob.manifest(job, "cloob-train-t", job_config(), "s3://w"), job)
        assert cluster.requests[-1]["method"] == "DELETE"
        assert cluster.requests[-1]["path"] == "/apis/trainer.kubeflow.org/v1alpha1/namespaces/ns-b/trainjobs/" \
                                               "cloob-train-t"  # outside a pod: the kubeconfig context's
        assert not cluster.pods  # the pods were stopped with the job


@pytest.fixture
def local_shards(mnist_train_shards):
    return mnist_train_shards


@pytest.mark.slow  # ~1 minute: two "nodes" train under torchrun (gloo on CPU)
@pytest.mark.parametrize("kind", ["pytorchjob", "trainjob"])
def test_a_two_node_job_trains_and_equals_one_process(kind, local_shards, tmp_path, s3_bucket, monkeypatch):
    params = yaml.safe_dump({"model": {"architecture": "cloob-tiny-vit"},  # no BatchNorm: ranks agree exactly
                             "train": {"steps": 4, "batch_size": 32, "data_streams": 4, "workers": 1,
                                       "log_every": 2, "tensorboard": False, "checkpoint_every": 2,
                                       "metrics_linger_s": 0}})  # no scraper here to wait for
    shards_uri = f"s3://{s3_bucket}/dvc/shards"  # the pods stream them from there; nothing is copied
    storage.upload_tree(local_shards, shards_uri)
    secret = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
              "AWS_ENDPOINT_URL": os.environ["AWS_ENDPOINT_URL"]}
    job = ClusterSettings(image="cloob:cuda", job_workdir=f"s3://{s3_bucket}/jobs", job_kind=kind, nodes=2, gpus=0,
                          job_poll_s=0.5, job_timeout_s=600, keep_checkpoints=kind == "pytorchjob")
    # The pods see only what the secret gives them: not this process's S3 settings.
    pod_env = {"AWS_ENDPOINT_URL": "", "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "OMP_NUM_THREADS": "1",
               "AWS_DEFAULT_REGION": "us-east-1"}
    with FakeTrainingCluster(secrets={"cloob-s3": secret}, extra_env=pod_env) as cluster:
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig(tmp_path / "kubeconfig")))
        try:
            metrics = kubeflow.train_multinode(params, shards_uri, str(tmp_path / "model"), job.to_json(),
                                               "Run-42")
        except Exception:
            key = next(iter(cluster.logs), None)
            print(textwrap.indent(cluster.pod_logs(key)[-4000:] if key else "no pods", "  pod| "))
            raise
    created = cluster.requests[0]["body"]
    assert created["metadata"]["name"] == "cloob-train-run-42"
    assert metrics["world_size"] == 2 and metrics["steps"] == 4
    workdir = f"s3://{s3_bucket}/jobs/cloob-train-run-42"
    # mirrored while it ran (a restarted pod resumes from there); once the model is out, deleted unless kept
    assert bool(storage.list_names(f"{workdir}/checkpoints", ".pt")) == job.keep_checkpoints
    assert not storage.list_names(f"{workdir}/shards")  # read where they lie, not copied for the job
    assert f"shards: {shards_uri}" in json.dumps(created)  # in the validated config the pods read

    single = tmp_path / "single"
    params_file = tmp_path / "params.yaml"
    params_file.write_text(params)
    run = subprocess.run([sys.executable, "-m", "cloob_core.cli", "train", "--params", str(params_file), "--shards",
                          str(local_shards), "--output", str(single), "--no-progress"], capture_output=True,
                         text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    one = load_file(single / "model" / "open_clip_model.safetensors")
    two = load_file(tmp_path / "model" / "model" / "open_clip_model.safetensors")
    worst = largest_difference(one, two)
    assert worst < 1e-6, worst  # the same global batch, split over two nodes


def test_the_job_pods_request_cpus_per_gpu_and_carry_nccl_settings():
    """Each pod of a 2-node x 8-GPU job: 88 CPUs requested (11 per GPU: a 96-vCPU node keeps the rest) and given to
    the thread budget, CUDA required, NCCL's defaults with the given ones over them, and on request the node's
    network and RDMA devices."""
    job = settings(nodes=2, gpus=8, nccl_env={"NCCL_SOCKET_IFNAME": "eth0", "NCCL_DEBUG": "INFO"},
                   host_network=True, rdma_resources={"rdma/rdma_shared_device_a": "1"})
    config = trainjob.job_config(load_config(), "s3://data/shards", "s3://w/n", gpus=job.gpus)
    body = trainjob.manifest(job, "n", config, "s3://w/n")
    for role in ("Master", "Worker"):
        pod = body["spec"]["pytorchReplicaSpecs"][role]["template"]["spec"]
        (container,) = pod["containers"]
        assert container["resources"]["requests"]["cpu"] == "88"
        assert container["resources"]["limits"] == {"nvidia.com/gpu": "8", "rdma/rdma_shared_device_a": "1"}
        env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
        assert env["LOKY_MAX_CPU_COUNT"] == {"resourceFieldRef": {"resource": "requests.cpu", "divisor": "1"}}
        assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["NCCL_DEBUG"] == "INFO"
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
        assert yaml.safe_load(env["CLOOB_PARAMS"])["train"]["device"] == "cuda"
        assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    plain = trainjob.manifest(settings(nodes=2, gpus=8), "n", config, "s3://w/n")
    pod = plain["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert "hostNetwork" not in pod and pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "8"}


def test_the_watcher_waits_out_api_faults_and_never_deletes_a_running_job(tmp_path, monkeypatch):
    """Status polls that hang past their deadline, are reset, or answer 5xx/429 (through the real kubernetes
    client) are asked again; the job runs to its end and is not deleted. The job carries its own deadline."""
    faults: list[str | int] = ["hang", "reset", 500, 503, 429, "hang", 502, 504]
    with FakeTrainingCluster(extra_env=_stub_python(tmp_path / "bin", "sleep 4\nexit 0\n"),
                             status_faults=faults) as cluster:
        cluster.hang_s = 1.0
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig(tmp_path / "kubeconfig")))
        job = settings(nodes=2, gpus=0, job_poll_s=0.05, job_api_timeout_s=0.3, job_timeout_s=3600, s3_secret="")
        body = trainjob.manifest(job, "cloob-train-api", job_config(), "s3://w")
        assert trainjob.run(body, job).startswith("Succeeded")
    assert [r["fault"] for r in cluster.requests if r["fault"]] == faults  # every fault was met
    assert not cluster.calls("DELETE", ".*")
    assert cluster.requests[0]["body"]["spec"]["runPolicy"]["activeDeadlineSeconds"] == 3600


class _FlakyApi:
    """The calls the watcher makes, answered from a script: what the issue's reproduction did (a read time-out on
    the third poll), then more."""

    def __init__(self, polls: list[object]):
        self.polls, self.calls, self.body = polls, [], {}

    def create_namespaced_custom_object(self, *args, **kwargs):
        self.calls.append("create")
        self.body = args[4]
        return self.body  # the object as stored

    def get_namespaced_custom_object(self, *args, **kwargs):
        self.calls.append("get")
        answer = self.polls.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return {**self.body, "status": {"conditions": [{"type": answer, "status": "True"}]}}

    def delete_namespaced_custom_object(self, *args, **kwargs):
        self.calls.append("DELETE")


def _api_error(status: int, message: str | None = None) -> Exception:
    from kubernetes.client.exceptions import ApiException

    err = ApiException(status=status, reason="fault")
    if message is not None:  # the Status the API server answers with
        err.body = json.dumps({"kind": "Status", "status": "Failure", "message": message, "code": status})
    return err


def test_a_read_timeout_on_a_status_poll_does_not_delete_the_job():
    from urllib3.exceptions import ProtocolError, ReadTimeoutError

    job = settings(nodes=2, gpus=0, job_poll_s=0.01, job_namespace="ml")
    api = _FlakyApi(["Running", "Running", ReadTimeoutError(None, "/", "read timed out"),
                     ProtocolError("Connection aborted.", ConnectionResetError(104, "reset")), _api_error(503),
                     ConnectionRefusedError(111, "refused"), "Running", "Succeeded"])
    trainjob.run(trainjob.manifest(job, "cloob-train-x", job_config(), "s3://w"), job, api=api)
    assert api.calls == ["create"] + ["get"] * 8  # no DELETE

    failing = _FlakyApi(["Running", _api_error(500), "Failed"])
    with pytest.raises(JobFailed, match="failed"):
        trainjob.run(trainjob.manifest(job, "cloob-train-y", job_config(), "s3://w"), job, api=failing)
    assert failing.calls[-1] == "DELETE"  # seen failing: deleted

    gone = _FlakyApi(["Running", _api_error(404)])
    with pytest.raises(JobFailed, match="deleted outside this run"):
        trainjob.run(trainjob.manifest(job, "cloob-train-z", job_config(), "s3://w"), job, api=gone)
    assert "DELETE" not in gone.calls

    refused = _FlakyApi(["Running", _api_error(403)])
    with pytest.raises(JobFailed, match=r"refused its status .*HTTP 403.* left to its deadline"):
        trainjob.run(trainjob.manifest(job, "cloob-train-w", job_config(), "s3://w"), job, api=refused)
    assert "DELETE" not in refused.calls  # not seen failing: its activeDeadlineSeconds bounds it


def test_polls_failing_until_the_deadline_delete_the_job():
    job = settings(nodes=2, gpus=0, job_poll_s=0.05, job_timeout_s=0.3, job_namespace="ml")
    api = _FlakyApi([TimeoutError("timed out")] * 50)
    with pytest.raises(JobFailed, match="did not finish in 0 s"):
        trainjob.run(trainjob.manifest(job, "cloob-train-d", job_config(), "s3://w"), job, api=api)
    assert api.calls[-1] == "DELETE"


def _workflow(cluster, name: str = "run-wf", namespace: str = "team-a") -> dict:
    """The run's Argo Workflow in the stand-in API server, running, as KFP's backend leaves it."""
    workflow = {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow",
                "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"},
                "spec": {"entrypoint": "entrypoint"}, "status": {"phase": "Running"}}
    cluster.objects[(namespace, "workflows", name)] = workflow
    return workflow


def _in_run(tmp_path, monkeypatch, cluster, workflow: str = "run-wf") -> None:
    """This process as the watcher pod of workflow ``workflow`` in namespace team-a."""
    namespace_file = tmp_path / "namespace"
    namespace_file.write_text("team-a")
    monkeypatch.setattr(trainjob, "_NAMESPACE_FILE", namespace_file)
    monkeypatch.setenv(trainjob.WORKFLOW_ENV, workflow)
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig(tmp_path / "kubeconfig")))
    monkeypatch.setattr(trainjob, "_apis", _kubeconfig_apis)


def _sigterm_once(cluster, key: tuple[str, str, str], before=lambda: None, again_after: float | None = None,
                  sent: list[float] | None = None) -> threading.Thread:
    """SIGTERM to this process once the job ``key`` exists, as a drain sends it to the watcher pod (and, with
    ``again_after``, once more that many seconds later, as Argo and the kubelet repeat it); the times go to
    ``sent``."""
    def send() -> None:
        for _ in range(500):
            if key in cluster.objects:
                break
            time.sleep(0.01)
        time.sleep(0.3)
        before()
        for delay in (0.0, again_after) if again_after is not None else (0.0,):
            time.sleep(delay)
            if sent is not None:
                sent.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def harmless_sigterm():
    """A SIGTERM that reaches this process after the watcher restored the handler before it does nothing (the
    default would end the test session)."""
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_a_sigterm_while_the_run_goes_on_deletes_nothing_and_the_next_try_adopts_the_job(tmp_path, monkeypatch):
    """A node drain, a consolidation or a spot reclaim sends the watcher SIGTERM while its pipeline run goes on:
    the job is left running (before: deleted), owned by the run's Workflow rather than the pod, and the step's
    next try adopts it to its end."""
    with FakeTrainingCluster(extra_env=_stub_python(tmp_path / "bin", "sleep 3\nexit 0\n")) as cluster:
        _in_run(tmp_path, monkeypatch, cluster)
        workflow = _workflow(cluster)
        job = settings(nodes=2, gpus=0, job_poll_s=0.05, job_namespace="team-a", s3_secret="")
        body = trainjob.manifest(job, "cloob-train-drain", job_config(), "s3://w")
        key = ("team-a", "pytorchjobs", "cloob-train-drain")
        _sigterm_once(cluster, key).join(timeout=0)
        with pytest.raises(JobFailed, match=r"while its pipeline run goes on .* left running, and the step's next "
                                            r"try adopts it"):
            trainjob.run(body, job)
        assert not cluster.calls("DELETE", ".*")
        owners = cluster.objects[key]["metadata"]["ownerReferences"]
        assert owners == [{"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "name": "run-wf",
                           "uid": workflow["metadata"]["uid"], "controller": False, "blockOwnerDeletion": False}]
        assert trainjob.run(body, job).startswith("Succeeded")  # the retry
    assert len(cluster.calls("POST", ".*")) == 2 and len(cluster.pods) == 1  # one job, adopted
    assert not cluster.calls("DELETE", ".*") and not cluster.calls("PATCH", ".*")  # its owner was there


@pytest.mark.parametrize("stop", ["kfp-terminate", "argo-stop", "deleted"])
def test_a_sigterm_after_the_run_was_stopped_deletes_the_job(tmp_path, monkeypatch, stop):
    with FakeTrainingCluster(extra_env=_stub_python(tmp_path / "bin", "sleep 30\nexit 0\n")) as cluster:
        _in_run(tmp_path, monkeypatch, cluster)
        workflow = _workflow(cluster)

        def stopped() -> None:  # what KFP's "terminate run" does, what `argo stop` does, the run deleted
            if stop == "kfp-terminate":
                workflow["spec"]["activeDeadlineSeconds"] = 0
            elif stop == "argo-stop":
                workflow["spec"]["shutdown"] = "Stop"
            else:
                del cluster.objects[("team-a", "workflows", "run-wf")]

        job = settings(nodes=2, gpus=0, job_poll_s=0.05, job_namespace="team-a", s3_secret="")
        body = trainjob.manifest(job, "cloob-train-stop", job_config(), "s3://w")
        _sigterm_once(cluster, ("team-a", "pytorchjobs", "cloob-train-stop"), stopped).join(timeout=0)
        with pytest.raises(JobFailed, match=r"cancelled: the pipeline run (was terminated|was stopped|is gone)"):
            trainjob.run(body, job)
        assert len(cluster.calls("DELETE", ".*pytorchjobs/cloob-train-stop")) == 1


def test_how_a_run_was_stopped_is_read_from_its_workflow():
    running = {"metadata": {"name": "w", "uid": "u"}, "spec": {}, "status": {"phase": "Running"}}
    assert trainjob.run_stopped(running) is None and trainjob.run_stopped(None) is None  # goes on; cannot tell
    assert "is gone" in trainjob.run_stopped({})
    deleting = {**running, "metadata": {"deletionTimestamp": "2026-11-28T00:00:00Z"}}
    assert "being deleted" in trainjob.run_stopped(deleting)
    assert "Terminate" in trainjob.run_stopped({**running, "spec": {"shutdown": "Terminate"}})
    assert "terminated" in trainjob.run_stopped({**running, "spec": {"activeDeadlineSeconds": 0}})
    assert trainjob.run_stopped({**running, "spec": {"activeDeadlineSeconds": 3600}}) is None
    assert "phase Failed" in trainjob.run_stopped({**running, "status": {"phase": "Failed"}})


def test_a_retried_watcher_adopts_a_job_its_pod_owned_and_adds_the_runs_workflow(tmp_path, monkeypatch):
    import urllib.request

    with FakeTrainingCluster(extra_env=_stub_python(tmp_path / "bin", "sleep 2\nexit 0\n")) as cluster:
        _in_run(tmp_path, monkeypatch, cluster)
        _workflow(cluster)
        job = settings(nodes=2, gpus=0, job_poll_s=0.05, job_namespace="team-a", s3_secret="")
        body = trainjob.manifest(job, "cloob-train-adopt", job_config(), "s3://w")
        first = {**body, "metadata": {**body["metadata"], "ownerReferences": [
            {"apiVersion": "v1", "kind": "Pod", "name": "watcher-1", "uid": "uid-1"}]}}
        request = urllib.request.Request(f"{cluster.url}/apis/kubeflow.org/v1/namespaces/team-a/pytorchjobs",
                                         data=json.dumps(first).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request).read()  # what a watcher of the version before created, owned by its pod
        assert trainjob.run(body, job).startswith("Succeeded")
        owners = cluster.objects[("team-a", "pytorchjobs", "cloob-train-adopt")]["metadata"]["ownerReferences"]
    assert [owner["uid"] for owner in owners] == ["uid-1", "uid-run-wf"]  # the pod's eviction no longer takes it
    assert len(cluster.calls("POST", ".*")) == 2 and len(cluster.pods) == 1  # one job, not a second one
    assert not cluster.calls("DELETE", ".*")


def _kubeconfig_apis():
    """The APIs from the test's kubeconfig, not the pod's service account its namespace file pretends."""
    from kubernetes import config

    config.load_kube_config(config_file=os.environ["KUBECONFIG"])
    return trainjob.clients()


def test_the_runs_workflow_in_the_jobs_namespace_owns_it(tmp_path, monkeypatch):
    namespace_file = tmp_path / "namespace"
    namespace_file.write_text("ml")
    monkeypatch.setattr(trainjob, "_NAMESPACE_FILE", namespace_file)
    monkeypatch.setenv(trainjob.WORKFLOW_ENV, "wf")
    created = []

    class Api(_FlakyApi):
        def create_namespaced_custom_object(self, group, version, namespace, plural, body, **kwargs):
            created.append(body)
            self.body = body
            return body

        def get_namespaced_custom_object(self, group, version, namespace, plural, name, **kwargs):
            if plural == "workflows":
                return {"metadata": {"name": name, "uid": "uid-wf"}, "spec": {}, "status": {"phase": "Running"}}
            return super().get_namespaced_custom_object(**kwargs)

    job = settings(nodes=2, gpus=0, job_poll_s=0.01, job_namespace="ml")
    trainjob.run(trainjob.manifest(job, "cloob-train-o", job_config(), "s3://w"), job, api=Api(["Succeeded"]))
    assert created[0]["metadata"]["ownerReferences"] == [{"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow",
                                                          "name": "wf", "uid": "uid-wf", "controller": False,
                                                          "blockOwnerDeletion": False}]
    other = settings(nodes=2, gpus=0, job_poll_s=0.01, job_namespace="elsewhere")  # no cross-namespace owner
    trainjob.run(trainjob.manifest(other, "cloob-train-p", job_config(), "s3://w"), other, api=Api(["Succeeded"]))
    assert "ownerReferences" not in created[1]["metadata"]


def test_a_missing_secret_keeps_the_pods_from_starting_and_the_job_is_deleted_at_its_deadline(tmp_path,
                                                                                              monkeypatch):
    """The S3 secret is required: a misspelled name stops the pods at their start (as the kubelet does, with
    CreateContainerConfigError), not a step at its first read of S3 with no credentials."""
    body = trainjob.manifest(settings(nodes=2, gpus=0), "cloob-train-s", job_config(), "s3://w")
    refs = [e["valueFrom"]["secretKeyRef"] for e in body["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
            ["containers"][0]["env"] if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]]
    assert {ref["key"]: ref["optional"] for ref in refs} == {"AWS_ACCESS_KEY_ID": False,
                                                             "AWS_SECRET_ACCESS_KEY": False, "AWS_ENDPOINT_URL": True}
    with FakeTrainingCluster(secrets={"cloob-s3-typo": {}}) as cluster:
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig(tmp_path / "kubeconfig")))
        job = settings(nodes=2, gpus=0, job_poll_s=0.05, job_pending_timeout_s=1.0, job_namespace="team-a")
        with pytest.raises(JobFailed, match=r"did not start in 1 s \(job_pending_timeout_s\): pod "
                                            r"cloob-train-s-master-0: CreateContainerConfigError: .*secret "
                                            r"\\?\"cloob-s3\\?\" not found"):
            trainjob.run(body, job)
        assert cluster.unstartable and not any(cluster.pods.values())
    assert cluster.requests[-1]["method"] == "DELETE"


def test_a_job_that_cannot_be_scheduled_says_why_and_ends_at_its_pending_deadline(tmp_path, monkeypatch, caplog):
    """No GPUs free: before, one line and a sleep until job_timeout_s (7 days). The watcher reads the pods' Events
    (the Role grants them), logs the scheduler's reason, and past job_pending_timeout_s deletes the job with it."""
    reason = "0/12 nodes are available: 8 Insufficient nvidia.com/gpu, 4 node(s) had untolerated taint."
    with FakeTrainingCluster(unschedulable=reason) as cluster:
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig(tmp_path / "kubeconfig")))
        job = settings(job_kind="trainjob", nodes=2, gpus=0, job_poll_s=0.05, job_pending_timeout_s=0.5,
                       job_namespace="team-a", s3_secret="")
        with caplog.at_level("INFO", logger="cloob_core.ops.trainjob"), \
                pytest.raises(JobFailed, match=r"did not start in 0 s \(job_pending_timeout_s\): Pod "
                                               r"cloob-train-p-node-0-\d: FailedScheduling: 0/12 nodes are "
                                               r"available: 8 Insufficient nvidia.com/gpu"):
            trainjob.run(trainjob.manifest(job, "cloob-train-p", job_config(), "s3://w"), job)
    assert "Pending: Pod cloob-train-p-node-0-" in caplog.text  # said while it waits, not only at the end
    assert cluster.requests[-1]["method"] == "DELETE"


def test_a_secret_without_an_endpoint_starts_the_pods_for_aws_s3(tmp_path, monkeypatch):
    """AWS S3 needs no endpoint, and docs/kubernetes.md says to leave it out: the pods start with the credentials
    alone (before, every pod stopped at CreateContainerConfigError)."""
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)  # the pods' environment is this one's, as an image's is
    stub = _stub_python(tmp_path / "bin", 'echo "key=$AWS_ACCESS_KEY_ID endpoint=${AWS_ENDPOINT_URL-unset}"\n')
    credentials = {"AWS_ACCESS_KEY_ID": "AKIA-test", "AWS_SECRET_ACCESS_KEY": "s3cret"}
    with FakeTrainingCluster(secrets={"cloob-s3": credentials}, extra_env=stub) as cluster:
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig(tmp_path / "kubeconfig")))
        job = settings(nodes=2, gpus=0, job_poll_s=0.05, job_namespace="team-a")
        assert trainjob.run(trainjob.manifest(job, "cloob-train-aws", job_config(), "s3://w"), job).startswith(
            "Succeeded")
        logs = cluster.pod_logs(("team-a", "pytorchjobs", "cloob-train-aws"))
    assert logs.count("key=AKIA-test endpoint=unset") == 2 and not cluster.unstartable


def test_the_job_pods_are_admitted_under_pod_security_restricted_and_pull_from_a_private_registry():
    for kind in trainjob.KINDS:
        job = settings(job_kind=kind, nodes=2, image_pull_secrets=["regcred"])
        body = trainjob.manifest(job, "cloob-train-r", job_config(), "s3://w")
        for pod in pod_settings(body):  # Trainer v2.3; v2.1's runtime must carry the context (docs/kubernetes.md)
            assert pod["securityContext"]["runAsNonRoot"] is True
            assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
            assert pod["imagePullSecrets"] == [{"name": "regcred"}]
            for container in pod["containers"]:
                assert container["securityContext"]["allowPrivilegeEscalation"] is False
                assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
            assert not pod.get("hostNetwork")


def test_efa_pods_ask_for_their_devices_and_nccl_uses_libfabric():
    """p5 / p4d nodes talk over EFA: each pod asks for vpc.amazonaws.com/efa and NCCL gets libfabric's EFA
    settings beneath the given nccl_env; one node has no use for EFA and is refused in one line."""
    job = settings(nodes=2, gpus=8, efa_devices=32, nccl_env={"FI_EFA_USE_DEVICE_RDMA": "0"})
    body = trainjob.manifest(job, "cloob-train-efa", job_config(), "s3://w")
    container = body["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "32"}
    env = {entry["name"]: entry.get("value") for entry in container["env"]}
    assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_FORK_SAFE"] == "1"
    assert env["FI_EFA_USE_DEVICE_RDMA"] == "0" and env["NCCL_DEBUG"] == "WARN"  # the given value wins
    plain = trainjob.manifest(settings(nodes=2, gpus=8), "cloob-train-p", job_config(), "s3://w")
    assert "FI_PROVIDER" not in json.dumps(plain)
    with pytest.raises(ValueError, match="efa_devices"):
        settings(nodes=1, efa_devices=4)


def test_the_watcher_talks_as_the_training_account_with_short_lived_tokens_bound_to_its_pod(tmp_path, monkeypatch):
    """Before, the step mounted a legacy token Secret of cloob-pipeline, which never expires. Now the step's own
    account requests tokens of cloob-pipeline (TokenRequest, an hour each, bound to the step's pod) and the watcher
    talks as it, renewing a token before it runs out; a step account without the right to request them, and a
    training account without the Role, are each one line naming the Role."""
    from kubernetes import config

    namespace_file = tmp_path / "namespace"
    namespace_file.write_text("team-a")
    monkeypatch.setattr(trainjob, "_NAMESPACE_FILE", namespace_file)
    monkeypatch.setenv(trainjob.POD_NAME_ENV, "run-abc-train-multinode-1")
    monkeypatch.setenv(trainjob.POD_UID_ENV, "uid-watcher-pod")
    with FakeTrainingCluster(extra_env=_stub_python(tmp_path / "bin", "sleep 3\nexit 0\n")) as cluster:
        config.load_kube_config(config_file=str(cluster.kubeconfig(tmp_path / "kubeconfig")))  # the pod's identity
        api, core = trainjob.clients("cloob-pipeline")
        job = settings(nodes=2, gpus=0, job_poll_s=0.05, job_namespace="team-a", s3_secret="")
        monkeypatch.setattr(trainjob, "TOKEN_RENEW_S", 3600 - 0.5)  # a token "runs out" after half a second
        assert trainjob.run(trainjob.manifest(job, "cloob-train-tok", job_config(), "s3://w"), job, api=api,
                            core=core).startswith("Succeeded")
        first, *renewed = cluster.tokens
        assert first == {"account": "team-a/cloob-pipeline", "lifetime": 3600, "token": "minted-1",
                         "by": "Bearer not-a-secret", "bound": {"apiVersion": "v1", "kind": "Pod",
                                                                "name": "run-abc-train-multinode-1",
                                                                "uid": "uid-watcher-pod"}}
        assert renewed and all(token["by"] == "Bearer not-a-secret" for token in renewed)  # asked as the pod
        jobs = [r for r in cluster.requests if "/pytorchjobs" in r["path"]]
        minted = {f"Bearer {token['token']}" for token in cluster.tokens}
        assert all(r["authorization"] in minted for r in jobs)  # the job's calls as the training account
        assert jobs[-1]["authorization"] == f"Bearer {renewed[-1]['token']}"  # with the newest token
        cluster.token_requesters = {"Bearer someone-else"}
        with pytest.raises(JobFailed, match=r"this step's account may not request tokens of the training account "
                                            r"team-a/cloob-pipeline \(HTTP 403\): bind the Role cloob-training-token"):
            trainjob.clients("cloob-pipeline")

    class Forbidden(_FlakyApi):
        def create_namespaced_custom_object(self, *args, **kwargs):
            raise _api_error(403, 'pytorchjobs.kubeflow.org is forbidden: User "system:serviceaccount:ml:default" '
                                  'cannot create resource "pytorchjobs" in API group "kubeflow.org"')

    job = settings(nodes=2, gpus=0, job_namespace="ml")
    with pytest.raises(JobFailed, match=r"refused creating PyTorchJob ml/cloob-train-x \(HTTP 403\): this step's "
                                        r"account lacks the Role cloob-training-jobs"):
        trainjob.run(trainjob.manifest(job, "cloob-train-x", job_config(), "s3://w"), job, api=Forbidden([]))


@pytest.mark.parametrize("kind, release", [("pytorchjob", "v2.3"), ("trainjob", "v2.1"), ("trainjob", "v2.3")])
def test_job_pods_carry_the_settings_labels_and_annotations_and_keep_istio_out(kind, release):
    """In a Kubeflow profile namespace Istio injects a sidecar into every pod, which breaks the job's rendezvous
    (kubeflow/trainer #1637, #2794): the job pods opt out by default; labels and annotations reach them all."""
    default = trainjob.manifest(settings(job_kind=kind, trainer_release=release), "cloob-train-i", job_config(),
                                "s3://w")
    spec = default["spec"]
    metas = ([replica["template"]["metadata"] for replica in spec["pytorchReplicaSpecs"].values()]
             if kind == "pytorchjob" else [o["metadata"] for o in spec.get("podTemplateOverrides", [])] or
             [job["template"]["spec"]["template"]["metadata"] for patch in spec["runtimePatches"]
              for job in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]])
    assert metas and all(meta["annotations"] == {"sidecar.istio.io/inject": "false", **trainjob.DO_NOT_DISRUPT}
                         for meta in metas)  # out of the mesh, and no consolidation moves a training pod
    assert all(meta["labels"]["app.kubernetes.io/component"] == "train" for meta in metas)
    labelled = trainjob.manifest(settings(job_kind=kind, trainer_release=release, pod_labels={"team": "vision"},
                                          pod_annotations={"example.com/owner": "ml"}, job_pod_annotations={}),
                                 "cloob-train-i", job_config(), "s3://w")
    text = json.dumps(labelled["spec"])
    assert '"team": "vision"' in text and '"example.com/owner": "ml"' in text and "sidecar.istio.io" not in text
    with pytest.raises(ValueError, match="not an annotation key"):
        settings(pod_annotations={"bad key": "x"})


GRACE_S = 3.0  # job_stop_grace_s of the hostile cases: the watcher must end within it (and a second for slack)


@pytest.mark.parametrize("fault", [503, "reset", "hang"])
def test_a_sigterm_with_the_workflow_unreadable_leaves_the_job_and_ends_in_one_line_within_the_grace(
        fault, tmp_path, monkeypatch, harmless_sigterm):
    """Two SIGTERMs a second apart while every read of the Workflow answers 503, is reset (the API down) or hangs
    past the grace: before, the second signal interrupted the read's retry and the watcher ended with an internal
    _Cancelled, or the reads' 20/40/80 s backoffs and 60 s time-outs outlasted the pod's 30 s grace and the kubelet's
    SIGKILL ended the step with no line. Now the job is left running and the step ends in one line within the grace."""
    with FakeTrainingCluster(extra_env=_stub_python(tmp_path / "bin", "sleep 30\nexit 0\n")) as cluster:
        cluster.hang_s = 60.0
        _in_run(tmp_path, monkeypatch, cluster)
        _workflow(cluster)
        job = settings(nodes=2, gpus=0, job_poll_s=0.05, job_namespace="team-a", s3_secret="",
                       job_stop_grace_s=GRACE_S)
        key = ("team-a", "pytorchjobs", "cloob-train-hostile")
        sent: list[float] = []
        sender = _sigterm_once(cluster, key, lambda: cluster.workflow_faults.extend([fault] * 100), again_after=1.0,
                               sent=sent)
        with pytest.raises(JobFailed, match=r"^PyTorchJob team-a/cloob-train-hostile: this watcher got signal 15 and "
                                            r"cannot tell whether its pipeline run was stopped \(workflow "
                                            r"team-a/run-wf could not be read: .*\): the job is left running, and "
                                            r"the step's next try adopts it$"):
            trainjob.run(trainjob.manifest(job, "cloob-train-hostile", job_config(), "s3://w"), job)
        ended = time.monotonic()
        sender.join(timeout=5)
        assert len(sent) == 2 and ended - sent[0] < GRACE_S + 1.0, (ended - sent[0])
        assert key in cluster.objects and not cluster.calls("DELETE", ".*")


def test_a_workflow_never_seen_is_no_proof_of_a_stopped_run(tmp_path, monkeypatch, harmless_sigterm):
    """CLOOB_WORKFLOW names a Workflow that answered 404 from the job's creation on (a wrong name, RBAC that hides
    it): before, a SIGTERM read it as "the run is gone" and deleted the job. Gone is proof only of what was seen."""
    with FakeTrainingCluster(extra_env=_stub_python(tmp_path / "bin", "sleep 30\nexit 0\n")) as cluster:
        _in_run(tmp_path, monkeypatch, cluster)  # and no Workflow object
        job = settings(nodes=2, gpus=0, job_poll_s=0.05, job_namespace="team-a", s3_secret="",
                       job_stop_grace_s=GRACE_S)
        key = ("team-a", "pytorchjobs", "cloob-train-unseen")
        _sigterm_once(cluster, key).join(timeout=0)
        with pytest.raises(JobFailed, match=r"cannot tell whether its pipeline run was stopped \(workflow "
                                            r"team-a/run-wf not found\): the job is left running"):
            trainjob.run(trainjob.manifest(job, "cloob-train-unseen", job_config(), "s3://w"), job)
        assert key in cluster.objects and not cluster.calls("DELETE", ".*")
        assert "ownerReferences" not in cluster.objects[key]["metadata"]


def test_a_job_in_another_namespace_is_deleted_when_its_run_is_terminated(tmp_path, monkeypatch, harmless_sigterm):
    """With job_namespace the job lives apart from the watcher: before, the Workflow was read only in the job's
    namespace, so a terminated run's job was never deleted and held its GPUs to its deadline. The Workflow is read
    where the watcher's pod lives; the job gets no owner across namespaces."""
    with FakeTrainingCluster(extra_env=_stub_python(tmp_path / "bin", "sleep 30\nexit 0\n")) as cluster:
        _in_run(tmp_path, monkeypatch, cluster)  # the watcher's pod in team-a
        workflow = _workflow(cluster)
        job = settings(nodes=2, gpus=0, job_poll_s=0.05, job_namespace="gpu-jobs", s3_secret="")
        key = ("gpu-jobs", "pytorchjobs", "cloob-train-far")

        def terminated() -> None:
            assert "ownerReferences" not in cluster.objects[key]["metadata"]
            workflow["spec"]["activeDeadlineSeconds"] = 0  # KFP's terminate

        _sigterm_once(cluster, key, terminated).join(timeout=0)
        with pytest.raises(JobFailed, match=r"PyTorchJob gpu-jobs/cloob-train-far cancelled: the pipeline run was "
                                            r"terminated"):
            trainjob.run(trainjob.manifest(job, "cloob-train-far", job_config(), "s3://w"), job)
    assert cluster.calls("GET", "/apis/argoproj.io/v1alpha1/namespaces/team-a/workflows/run-wf")
    assert len(cluster.calls("DELETE", "/apis/kubeflow.org/v1/namespaces/gpu-jobs/pytorchjobs/cloob-train-far")) == 1


def test_a_bug_in_the_watcher_never_deletes_a_healthy_job(tmp_path, monkeypatch):
    """Before, ``delete = True`` until proven otherwise: any exception of the watcher's own deleted the job."""
    def broken(kind, status):
        raise RuntimeError("a bug")

    with FakeTrainingCluster(extra_env=_stub_python(tmp_path / "bin", "sleep 30\nexit 0\n")) as cluster:
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.setattr(trainjob, "outcome", broken)
        job = settings(nodes=2, gpus=0, job_poll_s=0.05, job_namespace="team-a", s3_secret="")
        with pytest.raises(RuntimeError, match="a bug"):
            trainjob.run(trainjob.manifest(job, "cloob-train-bug", job_config(), "s3://w"), job)
        assert ("team-a", "pytorchjobs", "cloob-train-bug") in cluster.objects
    assert not cluster.calls("DELETE", ".*")


@pytest.mark.parametrize("kind", ["pytorchjob", "trainjob"])
def test_a_job_kueue_holds_in_its_queue_is_waited_for_not_deleted_as_pending(kind, tmp_path, monkeypatch, caplog):
    """Kueue queues a job by suspending it: before, the watcher counted it Pending (no pods) and deleted it after
    job_pending_timeout_s, and the job it made again went to the back of the queue. Now a suspended job is queued:
    the watcher says where it stands in the queue and why, and waits for its admission."""
    with FakeTrainingCluster(kueue=True, extra_env=_stub_python(tmp_path / "bin", "sleep 0.5\nexit 0\n")) as cluster:
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig(tmp_path / "kubeconfig")))
        job = settings(job_kind=kind, nodes=2, gpus=0, job_poll_s=0.05, job_pending_timeout_s=0.3,
                       job_namespace="team-a", s3_secret="", kueue_queue="team-a-gpus")
        plural = trainjob.KINDS[kind][2]
        key = ("team-a", plural, "cloob-train-q")

        def admit_later() -> None:
            time.sleep(1.5)  # five times the pending deadline
            cluster.admit(key)

        admitter = threading.Thread(target=admit_later, daemon=True)
        admitter.start()
        with caplog.at_level("INFO", logger="cloob_core.ops.trainjob"):
            text = trainjob.run(trainjob.manifest(job, "cloob-train-q", job_config(), "s3://w"), job)
        admitter.join()
    assert text.startswith(trainjob.SUCCEEDED[kind])
    assert ("Queued: suspended in Kueue's LocalQueue team-a-gpus, position 1 in it and 1 in its ClusterQueue; "
            "couldn't assign flavors to pod set node: insufficient unused quota for nvidia.com/gpu") in caplog.text
    assert not cluster.calls("DELETE", ".*") and len(cluster.calls("POST", ".*")) == 1


def test_a_job_never_admitted_ends_at_its_queue_deadline_and_an_admitted_one_is_not_judged_pending(tmp_path,
                                                                                                   monkeypatch):
    with FakeTrainingCluster(kueue=True) as cluster:
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig(tmp_path / "kubeconfig")))
        job = settings(nodes=2, gpus=0, job_poll_s=0.05, job_queue_timeout_s=0.5, job_namespace="team-a",
                       s3_secret="", kueue_queue="team-a-gpus")
        with pytest.raises(JobFailed, match=r"was not admitted in 0 s \(job_queue_timeout_s\): suspended in Kueue's "
                                            r"LocalQueue team-a-gpus, position 1 in it"):
            trainjob.run(trainjob.manifest(job, "cloob-train-never", job_config(), "s3://w"), job)
        assert cluster.requests[-1]["method"] == "DELETE"
    reason = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."
    with FakeTrainingCluster(kueue=True, unschedulable=reason) as cluster:
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig(tmp_path / "kubeconfig")))
        job = settings(nodes=2, gpus=0, job_poll_s=0.05, job_pending_timeout_s=0.2, job_timeout_s=2.0,
                       job_namespace="team-a", s3_secret="", kueue_queue="team-a-gpus")
        key = ("team-a", "pytorchjobs", "cloob-train-admitted")
        threading.Thread(target=lambda: (time.sleep(0.3), cluster.admit(key)), daemon=True).start()
        # admitted, its pods unschedulable: Kueue's waitForPodsReady is the judge, not job_pending_timeout_s
        with pytest.raises(JobFailed, match=r"did not finish in 2 s"):
            trainjob.run(trainjob.manifest(job, "cloob-train-admitted", job_config(), "s3://w"), job)


@pytest.fixture(scope="module")
def trainjob_package(tmp_path_factory):
    """A compiled two-node TrainJob pipeline, as a platform team would compile it."""
    from pipelines.__main__ import main

    path = tmp_path_factory.mktemp("package") / "multinode.yaml"
    assert main(["compile", "--output", str(path), "--nodes", "2", "--gpus", "8", "--job-kind", "trainjob",
                 "--job-workdir", "s3://cloob/jobs", "--job-namespace", "gpu-jobs"]) == 0
    return path


def test_preflight_prints_what_the_cluster_said_of_the_job_a_package_would_submit(trainjob_package, tmp_path,
                                                                                   monkeypatch, capsys):
    """`python -m pipelines preflight` creates the job body the package's step would submit with dryRun=All and
    strict validation: admitted on a cluster with Trainer v2.3, refused in the cluster's words (exit 1) on one with
    v2.1 or with a policy webhook that denies it; nothing is created either way."""
    from pipelines.__main__ import main

    cases = [({}, 0, r"^preflight: TrainJob gpu-jobs/cloob-train-preflight-[0-9a-f]{8}: admitted \(trainer"
                     r"\.kubeflow\.org/v1alpha1, 2 node\(s\) x 8 GPU\(s\); the dry run passed"),
             ({"releases": {"trainjobs": "v2.1.0"}}, 1,
              r'^pipelines: TrainJob gpu-jobs/cloob-train-preflight-[0-9a-f]{8}: refused: HTTP 400: TrainJob in '
              r'version "v1alpha1" cannot be handled as a TrainJob: strict decoding error: unknown field '
              r'"spec\.activeDeadlineSeconds", unknown field "spec\.runtimePatches"$'),
             ({"admission": lambda plural, body: "GPU jobs need the label team"}, 1,
              r'^pipelines: TrainJob gpu-jobs/cloob-train-preflight-[0-9a-f]{8}: refused: HTTP 403: admission '
              r'webhook "policy\.example\.com" denied the request: GPU jobs need the label team$')]
    for cluster_kwargs, status, expected in cases:
        with FakeTrainingCluster(**cluster_kwargs) as cluster:
            monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig(tmp_path / "kubeconfig")))
            assert main(["preflight", "--package", str(trainjob_package)]) == status
            (sent,) = cluster.calls("POST", ".*")
            assert "dryRun=All" in sent["query"] and "fieldValidation=Strict" in sent["query"]
            assert sent["path"] == "/apis/trainer.kubeflow.org/v1alpha1/namespaces/gpu-jobs/trainjobs"
            assert not cluster.objects and not cluster.pods
        out, err = capsys.readouterr()
        assert re.search(expected, (out if status == 0 else err).strip()), (out, err)


def test_submit_refuses_a_package_whose_job_settings_this_version_cannot_run(trainjob_package, tmp_path):
    """A package written by another version or edited by hand: before, an unknown field or trainer_release v2.2 got
    past every check and failed at the training step, after the data steps ran."""
    from pipelines import client

    text = trainjob_package.read_text()
    for old, new, said in (('"trainer_release":"v2.3"', '"trainer_release":"v9"',
                            r"trainer_release: Input should be 'v2\.1', 'v2\.2' or 'v2\.3'"),
                           ('"nodes":2,', '"nodes":2,"gpu_count":8,', r"gpu_count: unknown key")):
        assert old in text, old
        edited = tmp_path / "edited.yaml"
        edited.write_text(text.replace(old, new))
        with pytest.raises(Exception, match=rf"edited.yaml: its training job's settings are not this version's "
                                            rf"\(invalid job settings: {said}.*compile it again"):
            client.run_parameters("params.yaml", ["promote.store=s3://cloob/registry"], package=str(edited))


def test_a_job_may_have_a_disruption_budget_of_its_own_that_goes_with_it(tmp_path, monkeypatch):
    """job_disruption_budget: a PodDisruptionBudget for the job's pods alone, an integer minAvailable of all of them
    (what Kubernetes takes for pods no built-in controller owns), owned by the job, so the garbage collector deletes
    it with the job; a retried watcher finds it there."""
    with FakeTrainingCluster(extra_env=_stub_python(tmp_path / "bin", "sleep 0.5\nexit 0\n")) as cluster:
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.setattr(trainjob, "_apis", _kubeconfig_apis)
        job = settings(job_kind="trainjob", nodes=3, gpus=0, job_poll_s=0.05, job_namespace="team-a", s3_secret="",
                       job_disruption_budget=True)
        body = trainjob.manifest(job, "cloob-train-pdb", job_config(), "s3://w")
        assert trainjob.run(body, job).startswith("Complete")
        (created,) = cluster.calls("POST", "/apis/policy/v1/namespaces/team-a/poddisruptionbudgets")
        budget = created["body"]
        assert "fieldValidation=Strict" in created["query"]
        assert budget["spec"] == {"minAvailable": 3,
                                  "selector": {"matchLabels": {"jobset.sigs.k8s.io/jobset-name": "cloob-train-pdb"}}}
        (owner,) = budget["metadata"]["ownerReferences"]
        stored = cluster.objects[("team-a", "trainjobs", "cloob-train-pdb")]
        uid = stored["metadata"]["uid"]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("TrainJob", "cloob-train-pdb", uid)
        assert trainjob.run(body, job).startswith("Complete")  # adopted: its budget is there already, no error
        trainjob.end_job(job, "cloob-train-pdb")
        assert ("team-a", "poddisruptionbudgets", "cloob-train-pdb") not in cluster.objects  # gone with its job


def test_the_runs_exit_handler_deletes_the_job_left_and_says_so(tmp_path, monkeypatch):
    """A watcher pod deleted by a drain ends its step as Error, which KFP's retry does not cover: the run fails and
    nothing watches the job. The run's exit handler deletes it; when none is left it says so."""
    with FakeTrainingCluster(extra_env=_stub_python(tmp_path / "bin", "sleep 30\nexit 0\n")) as cluster:
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.setattr(trainjob, "_apis", _kubeconfig_apis)
        job = settings(nodes=2, gpus=0, job_namespace="team-a", s3_secret="")
        name = trainjob.job_name("run-77")
        trainjob.create_job(_kubeconfig_apis()[0], trainjob.manifest(job, name, job_config(), "s3://w"), "team-a",
                            job)
        assert cluster.pods[("team-a", "pytorchjobs", name)]
        assert kubeflow.end_training_job(job.to_json(), "run-77") == \
            f"PyTorchJob team-a/{name}: deleted at the run's end (nothing watches it any more)"
        assert not cluster.pods and ("team-a", "pytorchjobs", name) not in cluster.objects
        assert kubeflow.end_training_job(job.to_json(), "run-77") == f"PyTorchJob team-a/{name}: none left to end"


class _AirflowApi(JsonApiServer):
    """A stand-in of Airflow's REST API (v2) with one DAG run and its watcher task instance: sign-in with a user's
    password (``POST /auth/token``), the two reads the watcher makes (tests/test_airflow_watcher.py runs the same
    against Airflow's own API server)."""

    RUN = "/api/v2/dags/cloob_pretrain/dagRuns/manual__2026-12-04T01:00:00+00:00"

    def __init__(self) -> None:
        super().__init__()
        self.run_state: str | None = "running"  # None: the DAG run is gone
        self.task_state: str | None = "running"
        self.refuse: int | None = None  # an HTTP status every read answers

    def _answer(self, method: str, path: str, query: str, body: dict) -> tuple[int, dict]:
        if method == "POST" and path == "/auth/token":
            ok = body == {"username": "watcher", "password": "pw"}
            return (201, {"access_token": "t0k"}) if ok else (401, {"detail": "Invalid credentials"})
        if self.refuse:
            return self.refuse, {"detail": "refused"}
        if self.requests[-1]["authorization"] != "Bearer t0k":
            return 403, {"detail": "Forbidden"}
        path = urllib.parse.unquote(path)
        if self.run_state is None:
            return 404, {"detail": "The DagRun was not found"}
        if path == urllib.parse.unquote(self.RUN):
            return 200, {"dag_id": "cloob_pretrain", "state": self.run_state}
        if path == urllib.parse.unquote(self.RUN) + "/taskInstances/train_multinode":
            return 200, {"task_id": "train_multinode", "map_index": -1, "state": self.task_state}
        return 404, {"detail": "not found"}


def under_airflow(tmp_path, monkeypatch, cluster, api: str, run_id: str = "manual__2026-12-04T01:00:00+00:00",
                  user: tuple[str, str] = ("watcher", "pw")) -> None:
    """This process as the watcher pod of task train_multinode of an Airflow run, with the environment
    pipelines/airflow_pods.py gives it (no Workflow: Airflow has none)."""
    _in_run(tmp_path, monkeypatch, cluster)
    monkeypatch.delenv(trainjob.WORKFLOW_ENV)
    monkeypatch.setenv(airflow_run.TASK_ENV, json.dumps({"dag_id": "cloob_pretrain", "run_id": run_id,
                                                         "task_id": "train_multinode", "map_index": -1}))
    monkeypatch.setenv(airflow_run.API_ENV, api)
    monkeypatch.setenv(airflow_run.USERNAME_ENV, user[0])
    monkeypatch.setenv(airflow_run.PASSWORD_ENV, user[1])


@pytest.mark.parametrize(("action", "deleted"), [
    ("none: a worker restart", False), ("task marked failed", True), ("task cleared", True),
    ("run marked failed", True), ("run deleted", True), ("API refuses", False)])
def test_under_airflow_a_sigterm_deletes_the_job_only_when_the_airflow_run_was_stopped(tmp_path, monkeypatch,
                                                                                       action, deleted):
    """Under Airflow the watcher's SIGTERM comes both from a person (the task or its run marked failed, the task
    cleared: Airflow deletes the task's pod) and from a worker's restart while the run goes on; the task instance
    and DAG run, read from Airflow's API after the signal, tell them apart (before: there was no Workflow to read,
    so a stopped run's job held its GPU nodes to its deadline)."""
    with FakeTrainingCluster(extra_env=_stub_python(tmp_path / "bin", "sleep 30\nexit 0\n")) as cluster, \
            _AirflowApi() as airflow:
        under_airflow(tmp_path, monkeypatch, cluster, airflow.url)

        def act() -> None:  # what Airflow's API server records before it stops the task
            if action == "task marked failed":
                airflow.task_state = "failed"
            elif action == "task cleared":
                airflow.task_state = "restarting"
            elif action == "run marked failed":
                airflow.run_state = "failed"
            elif action == "run deleted":
                airflow.run_state = None
            elif action == "API refuses":
                airflow.refuse = 403

        job = settings(nodes=2, gpus=0, job_poll_s=0.05, job_namespace="team-a", s3_secret="")
        body = trainjob.manifest(job, "cloob-train-af", job_config(), "s3://w")
        _sigterm_once(cluster, ("team-a", "pytorchjobs", "cloob-train-af"), act).join(timeout=0)
        expected = r"cancelled: the pipeline run (was stopped|was cleared|has ended|is gone)" if deleted else \
            r"left running, and the step's next try adopts it"
        with pytest.raises(JobFailed, match=expected):
            trainjob.run(body, job)
        assert len(cluster.calls("DELETE", ".*pytorchjobs/cloob-train-af")) == (1 if deleted else 0)
        assert "ownerReferences" not in cluster.calls("POST", ".*pytorchjobs")[0]["body"]["metadata"]
    assert not cluster.calls("GET", ".*/workflows/.*")  # Argo's Workflow is not asked under Airflow
    reads = airflow.calls("GET", ".*")
    assert len(reads) >= 2 and all(r["path"].startswith("/api/v2/dags/cloob_pretrain/dagRuns/") for r in reads)


def test_how_an_airflow_run_was_stopped_is_read_from_its_states():
    def state(run: str, task: str | None) -> dict:
        return {"dag_run": {"state": run}, "task_instance": {"state": task}}

    for going_on in ("running", "up_for_retry", "queued", "scheduled", "deferred", "up_for_reschedule"):
        assert airflow_run.run_stopped(state("running", going_on)) is None
    assert airflow_run.run_stopped(None) is None and airflow_run.run_stopped({}, seen=False) is None
    assert "is gone" in airflow_run.run_stopped({})
    for ended in ("failed", "success", "skipped", "upstream_failed", "removed"):
        assert f"task instance is {ended}" in airflow_run.run_stopped(state("running", ended))
    assert "cleared" in airflow_run.run_stopped(state("running", "restarting"))
    assert "cleared" in airflow_run.run_stopped(state("queued", None))
    assert "DAG run is failed" in airflow_run.run_stopped(state("failed", "up_for_retry"))
    assert airflow_run.task_from_env() is None
