"""infra/ checked offline: the kustomize overlays render and validate against the Kubernetes schemas (strict),
the alert rules pass `promtool check rules` and their unit tests, the training jobs' pod templates are valid
Kubernetes, the monitors select the pods that serve metrics, and the Dockerfile lints clean.

The tools: kubectl (kustomize), promtool (Debian's prometheus package; .ci/run installs it), hadolint and
kubernetes-validate (the dev extra). Without one a test is skipped here, but fails in CI (CI=true)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cloob_core.config import CloobConfig
from cloob_core.config.cluster import ClusterSettings
from cloob_core.ops import trainjob

REPO = Path(__file__).resolve().parents[1]
INFRA = REPO / "infra"
OVERLAYS = ("standalone", "multi-user")
K8S_VERSION = "1.34"


def tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing: CI must validate infra/ (see .ci/run)")
        pytest.skip(f"{name} is not installed")
    return found


def validator():
    try:
        import kubernetes_validate
    except ImportError:
        tool("kubernetes-validate")  # skips, or fails in CI
    return kubernetes_validate


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    out = subprocess.run([tool("kubectl"), "kustomize", str(INFRA / "k8s" / "overlays" / request.param)],
                         capture_output=True, text=True, check=True).stdout
    return request.param, [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(documents: list[dict], kind: str) -> list[dict]:
    return [doc for doc in documents if doc["kind"] == kind]


def test_overlays_render_and_every_core_resource_validates_strictly(rendered):
    overlay, documents = rendered
    kv = validator()
    core = [doc for doc in documents if not doc["apiVersion"].startswith("monitoring.coreos.com")]
    for doc in core:
        kv.validate(doc, K8S_VERSION, strict=True)  # raises on an unknown or missing field
    kinds = {doc["kind"] for doc in documents}
    assert {"ServiceAccount", "Role", "RoleBinding", "PodMonitor", "PrometheusRule", "Deployment",
            "ServiceMonitor"} <= kinds
    claims = {doc["metadata"]["name"] for doc in documents if doc["kind"] == "PersistentVolumeClaim"}
    assert claims == {"cloob-pushgateway", *(["cloob-minio"] if overlay == "standalone" else [])}  # MinIO: no S3 there
    gateway = next(doc for doc in documents if doc["kind"] == "Deployment" and doc["metadata"]["name"] ==
                   "cloob-pushgateway")
    assert gateway["spec"]["template"]["spec"]["volumes"] == [  # its pushes outlive a restart
        {"name": "data", "persistentVolumeClaim": {"claimName": "cloob-pushgateway"}}]
    namespace = {doc["metadata"].get("namespace") for doc in documents}
    assert len(namespace) == 1 and None not in namespace


def test_a_bad_field_is_caught_by_the_validator():
    kv = validator()
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
                  "spec": {"selector": {"matchLabels": {"a": "b"}}, "template": {
                      "metadata": {"labels": {"a": "b"}}, "spec": {"containers": [{"name": "c", "imge": "i"}]}}}}
    with pytest.raises(kv.ValidationError, match="imge"):
        kv.validate(deployment, K8S_VERSION, strict=True)


def test_rbac_lets_only_the_training_account_run_training_jobs(rendered):
    overlay, documents = rendered
    roles = {doc["metadata"]["name"]: doc for doc in by_kind(documents, "Role")}
    bindings = {doc["metadata"]["name"]: doc for doc in by_kind(documents, "RoleBinding")}
    role = roles["cloob-training-jobs"]
    granted = {(group, resource): set(rule["verbs"]) for rule in role["rules"] for group in rule["apiGroups"]
               for resource in rule["resources"]}
    for kind in trainjob.KINDS.values():  # what trainjob.run calls: create, get, delete
        assert {"create", "get", "delete"} <= granted[(kind[0], kind[2])]
    # only the training account, as which the multi-node step and the exit handler alone talk: not the account
    # every step of every pipeline in the namespace runs as (before: pipeline-runner could delete any job)
    binding = bindings["cloob-training-jobs"]
    assert [subject["name"] for subject in binding["subjects"]] == [ClusterSettings().job_account]
    assert all(subject.get("namespace") == binding["metadata"]["namespace"] for subject in binding["subjects"])
    # and no long-lived token of it (before: a legacy service-account-token Secret): the steps' own account may
    # request short-lived ones of it alone
    assert not [doc for doc in by_kind(documents, "Secret") if doc.get("type") == "kubernetes.io/service-account-token"]
    (rule,) = roles["cloob-training-token"]["rules"]
    assert (rule["resources"], rule["resourceNames"], rule["verbs"]) == (["serviceaccounts/token"],
                                                                        ["cloob-pipeline"], ["create"])
    steps_account = "pipeline-runner" if overlay == "standalone" else "default-editor"
    assert [s["name"] for s in bindings["cloob-training-token"]["subjects"]] == [steps_account]


def test_the_pod_monitor_selects_the_training_pods_and_their_metrics_port(rendered):
    _, documents = rendered
    monitors = {doc["metadata"]["name"]: doc for doc in by_kind(documents, "PodMonitor")}
    monitor = monitors["cloob-training"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    settings = ClusterSettings(image="i", job_workdir="s3://w", nodes=2)
    config = trainjob.job_config(CloobConfig(), "s3://d", "s3://w")
    # a TrainJob's pods carry the labels and serve on the default port, to which cloob-trainjob rewrites rank 0's
    # address (the Prometheus test below shows the target)
    trainer = monitors["cloob-trainjob"]
    (address,) = [rule for rule in trainer["spec"]["podMetricsEndpoints"][0]["relabelings"]
                  if rule.get("targetLabel") == "__address__"]
    assert address["replacement"] == f"${{1}}:{ClusterSettings().metrics_port}"
    assert config.train.metrics_port == ClusterSettings().metrics_port
    for release in ("v2.1", "v2.2", "v2.3"):
        body = trainjob.manifest(settings.model_copy(update={"job_kind": "trainjob", "trainer_release": release}),
                                 "n", config, "s3://w")
        patches = body["spec"].get("podTemplateOverrides") or [
            job["template"]["spec"]["template"] for patch in body["spec"]["runtimePatches"]
            for job in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]]
        assert trainer["spec"]["selector"]["matchLabels"].items() <= patches[0]["metadata"]["labels"].items()
    replicas = trainjob.manifest(settings, "n", config, "s3://w")["spec"]["pytorchReplicaSpecs"]
    pod = replicas["Master"]["template"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    ports = {port["name"] for port in pod["spec"]["containers"][0]["ports"]}
    assert {endpoint["port"] for endpoint in monitor["spec"]["podMetricsEndpoints"]} <= ports
    assert "ports" not in replicas["Worker"]["template"]["spec"]["containers"][0]  # only rank 0 serves metrics
    (service_monitor,) = by_kind(documents, "ServiceMonitor")
    services = {doc["metadata"]["name"]: doc for doc in by_kind(documents, "Service")}
    gateway = services["cloob-pushgateway"]
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= gateway["metadata"]["labels"].items()
    assert service_monitor["spec"]["endpoints"][0]["honorLabels"] is True  # the pushers' job/partition labels


@pytest.mark.parametrize("kind, release", [("pytorchjob", "v2.3"), ("trainjob", "v2.1"), ("trainjob", "v2.3")])
def test_training_job_pod_templates_are_valid_kubernetes(kind, release):
    """The operators copy these into pods: as a core PodTemplate they must validate strictly (the job APIs'
    own fields: tests/test_trainjob.py, against the operators' CRDs in tests/crds)."""
    kv = validator()
    settings = ClusterSettings(image="reg/cloob:cuda", job_workdir="s3://w", job_kind=kind, nodes=3,
                               trainer_release=release, node_selector={"pool": "a100"},
                               service_account="cloob-pipeline")
    body = trainjob.manifest(settings, "cloob-train-x", trainjob.job_config(CloobConfig(), "s3://d", "s3://w/x"),
                             "s3://w/x")
    spec = body["spec"]
    if kind == "pytorchjob":
        templates = [replica["template"] for replica in spec["pytorchReplicaSpecs"].values()]
    else:  # the trainer's container (with the runtime's defaults) plus the node job's override or patch
        trainer = spec["trainer"]
        if release == "v2.1":
            pod = spec["podTemplateOverrides"][0]
        else:
            pod = spec["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0][
                "template"]["spec"]["template"]
        container = {"name": "node", "image": trainer["image"], "command": trainer["command"],
                     "env": trainer["env"], "resources": trainer["resourcesPerNode"], **pod["spec"]["containers"][0]}
        rest = {key: value for key, value in pod["spec"].items() if key != "containers"}
        templates = [{"metadata": pod["metadata"], "spec": {**rest, "containers": [container]}}]
    for template in templates:
        kv.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template},
                    K8S_VERSION, strict=True)


def test_alert_rules_pass_promtool_and_their_unit_tests():
    promtool, monitoring = tool("promtool"), INFRA / "monitoring"
    check = subprocess.run([promtool, "check", "rules", "alerts.rules.yml"], cwd=monitoring, capture_output=True,
                           text=True)
    assert check.returncode == 0 and "SUCCESS: 12 rules found" in check.stdout, check.stdout + check.stderr
    tested = subprocess.run([promtool, "test", "rules", str(monitoring / "alerts.test.yml")], capture_output=True,
                            text=True)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    rules = yaml.safe_load((monitoring / "alerts.rules.yml").read_text())
    names = {r["alert"] for group in rules["groups"] for r in group["rules"]}
    tests = yaml.safe_load((monitoring / "alerts.test.yml").read_text())["tests"]
    covered = {case["alertname"] for test in tests for case in test["alert_rule_test"] if case["exp_alerts"]}
    assert covered == names  # every alert is shown to fire


def test_the_prometheus_rule_resource_is_built_from_the_rules_file(tmp_path):
    """The resource the cluster gets holds exactly the rule groups promtool checked; a stale one fails here."""
    builder = INFRA / "monitoring" / "build_rule_resource.py"
    check = subprocess.run([sys.executable, str(builder), "--check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    resource = yaml.safe_load((INFRA / "k8s" / "base" / "prometheusrule.yaml").read_text())
    rules = yaml.safe_load((INFRA / "monitoring" / "alerts.rules.yml").read_text())
    assert resource["kind"] == "PrometheusRule" and resource["spec"] == rules
    # A rule edited without rebuilding is caught.
    spec = importlib.util.spec_from_file_location("build_rule_resource", builder)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    edited = (INFRA / "monitoring" / "alerts.rules.yml").read_text().replace("for: 5m", "for: 6m", 1)
    module.RULES, module.RESOURCE = tmp_path / "alerts.rules.yml", tmp_path / "prometheusrule.yaml"
    module.RULES.write_text(edited)
    module.RESOURCE.write_text((INFRA / "k8s" / "base" / "prometheusrule.yaml").read_text())
    assert module.main(["--check"]) == 1
    assert module.main([]) == 0 and module.main(["--check"]) == 0
    assert yaml.safe_load(module.RESOURCE.read_text())["spec"] == yaml.safe_load(edited)


def test_the_dockerfile_lints_clean_and_its_final_stage_is_minimal():
    dockerfile = INFRA / "images" / "Dockerfile"
    lint = subprocess.run([tool("hadolint"), str(dockerfile)], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    final = dockerfile.read_text().rsplit("\nFROM ", 1)[1]
    assert "apt-get" not in final and "build-essential" not in final and "pip install" not in final
    assert "USER 10001:10001" in final and "COPY --from=build /opt/cloob /opt/cloob" in final
    # the code after the dependencies and the labels last, so that a code change or the other variant reuses the
    # dependencies' layer (GBs) from the build cache
    lines = [line.split()[0] for line in final.splitlines()[1:] if line and line[0].isupper()]
    assert final.index("COPY --from=build") < final.index("COPY --from=code") < final.index("LABEL")
    assert lines[-1] == "LABEL" and "ARG" not in lines[:lines.index("CMD")], lines


def _git_stub(folder: Path, status: str) -> dict[str, str]:
    """A `git` on PATH that names commit 0123456789ab and reports ``status`` for `git status --porcelain`."""
    folder.mkdir(parents=True, exist_ok=True)
    stub = folder / "git"
    stub.write_text('#!/bin/sh\ncase "$*" in *rev-parse*) echo 0123456789ab ;; *status*) printf "%s" "$STUB_STATUS" ;; '
                    "esac\n")
    stub.chmod(0o755)
    return {"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}", "STUB_STATUS": status}


def test_the_build_script_tags_the_images_the_components_use(tmp_path):
    """The tags name one build (version and commit), the CPU image takes torch's CPU wheels unless told otherwise,
    and a push from a tree whose image inputs have uncommitted changes is refused (the tag would name two builds)."""
    clean = {**os.environ, "PYTHON": sys.executable, **_git_stub(tmp_path / "bin", "")}
    names = subprocess.run([sys.executable, "-c", "from components.images import CPU_IMAGE, CUDA_IMAGE; "
                            "print(CPU_IMAGE, CUDA_IMAGE)"], capture_output=True, text=True, env=clean, check=True,
                           cwd=INFRA.parent).stdout.split()
    assert names == ["cloob-pipelines:0.1.0-0123456789ab-cpu", "cloob-pipelines:0.1.0-0123456789ab-cuda"]
    cpu, cuda = names
    out = subprocess.run([str(INFRA / "images" / "build.sh"), "--dry-run", "--push"], capture_output=True,
                         text=True, env=clean, check=True).stdout
    assert f"-t {cuda} ." in out and f"-t {cpu} ." in out
    assert f"push {cuda}" in out and f"push {cpu}" in out
    assert "--build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in out
    renamed = subprocess.run([str(INFRA / "images" / "build.sh"), "--dry-run"], capture_output=True, text=True,
                             env={**clean, "CLOOB_IMAGE_CUDA": "registry.internal/ml/cloob:gpu",
                                  "TORCH_INDEX_URL": ""}, check=True).stdout
    assert "-t registry.internal/ml/cloob:gpu ." in renamed and "TORCH_INDEX_URL= " in renamed
    dirty = {**clean, **_git_stub(tmp_path / "bin", " M cloob_core/io.py")}
    refused = subprocess.run([str(INFRA / "images" / "build.sh"), "--dry-run", "--push"], capture_output=True,
                             text=True, env=dirty)
    assert refused.returncode == 2 and "uncommitted changes to the image's inputs" in refused.stderr


def monitoring_validators() -> dict[str, object]:
    """A strict validator per Prometheus Operator kind, from infra/monitoring/crd_schemas.yaml."""
    import jsonschema

    schemas = yaml.safe_load((INFRA / "monitoring" / "crd_schemas.yaml").read_text())
    definitions = schemas.pop("definitions")
    return {kind: jsonschema.Draft7Validator({**schema, "definitions": definitions})
            for kind, schema in schemas.items()}


def test_the_monitoring_resources_validate_against_their_schemas(rendered):
    """PodMonitor, ServiceMonitor and PrometheusRule, which kubernetes-validate has no schema for, against ours:
    strict, so a misspelled field fails here instead of being pruned by the API server."""
    _, documents = rendered
    validators = monitoring_validators()
    monitoring = [doc for doc in documents if doc["apiVersion"].startswith("monitoring.coreos.com")]
    assert {doc["kind"] for doc in monitoring} == {"PodMonitor", "ServiceMonitor", "PrometheusRule"}
    for doc in monitoring:
        errors = [f"{list(error.path)}: {error.message}" for error in validators[doc["kind"]].iter_errors(doc)]
        assert not errors, (doc["kind"], errors)
    monitor = by_kind(documents, "PodMonitor")[0]
    broken = json.loads(json.dumps(monitor))
    broken["spec"]["podMetricsEndpoints"][0]["intervall"] = "30s"
    assert list(validators["PodMonitor"].iter_errors(broken))
    (rules,) = by_kind(documents, "PrometheusRule")
    broken = json.loads(json.dumps(rules))
    broken["spec"]["groups"][0]["rules"][0]["for"] = "5 minutes"
    assert list(validators["PrometheusRule"].iter_errors(broken))


def test_the_steps_credentials_are_not_minios_root(rendered):
    """Standalone: MinIO's administrator credentials (cloob-minio-root) reach only MinIO and its set-up Job; the
    steps' secret cloob-s3 is a MinIO user whose policy allows the cloob bucket and nothing else."""
    overlay, documents = rendered
    if overlay != "standalone":  # no MinIO there: the cluster's own S3
        assert not by_kind(documents, "Job") and "cloob-minio-root" not in json.dumps(documents)
        return
    (minio,) = [doc for doc in by_kind(documents, "Deployment") if doc["metadata"]["name"] == "cloob-minio"]
    env = minio["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {entry["valueFrom"]["secretKeyRef"]["name"] for entry in env} == {"cloob-minio-root"}
    (setup,) = by_kind(documents, "Job")
    container = setup["spec"]["template"]["spec"]["containers"][0]
    values = {entry["name"]: entry.get("value") for entry in container["env"]}
    policy = json.loads(values["BUCKET_POLICY"])
    (statement,) = policy["Statement"]
    assert statement["Resource"] == ["arn:aws:s3:::cloob", "arn:aws:s3:::cloob/*"] and statement["Effect"] == "Allow"
    script = container["args"][0]
    # a versioned bucket on a fixed volume: old versions of rotated checkpoints are reclaimed, not kept for ever
    (rule,) = json.loads(values["LIFECYCLE"])["Rules"]
    assert rule["Status"] == "Enabled" and rule["NoncurrentVersionExpiration"] == {"NoncurrentDays": 7}
    assert rule["Expiration"] == {"ExpiredObjectDeleteMarker": True} and rule["Filter"] == {"Prefix": ""}
    assert 'printf \'%s\' "$LIFECYCLE" | mc ilm import cloob/cloob' in script
    assert 'mc admin user add cloob "$AWS_ACCESS_KEY_ID"' in script
    assert "mc admin policy attach cloob cloob-pipeline" in script
    assert subprocess.run(["sh", "-n", "-c", script]).returncode == 0  # parses as shell


def test_only_the_namespace_and_prometheus_reach_the_pushgateway(rendered):
    """A NetworkPolicy in front of the Pushgateway: its pods, its port, and ingress from the namespace's own pods
    (the steps and the job pods that push) and from Prometheus's namespace, nothing else."""
    _, documents = rendered
    (policy,) = by_kind(documents, "NetworkPolicy")
    (gateway,) = [doc for doc in by_kind(documents, "Deployment") if doc["metadata"]["name"] == "cloob-pushgateway"]
    selected = policy["spec"]["podSelector"]["matchLabels"]
    assert selected.items() <= gateway["spec"]["template"]["metadata"]["labels"].items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": 9091, "protocol": "TCP"}]
    assert {"podSelector": {}} in rule["from"]  # the namespace's own pods only: no namespaceSelector beside it
    others = [peer for peer in rule["from"] if peer != {"podSelector": {}}]
    assert others == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]


# The Training Operator's built-in init container (kubeflow/training-operator, pkg/controller.v1/pytorch): what a
# Worker gets unless the operator is given a template file.
OPERATOR_INIT_TEMPLATE = """
- name: init-pytorch
  image: {{.InitContainerImage}}
  imagePullPolicy: IfNotPresent
  resources:
    limits:
      cpu: 100m
      memory: 20Mi
    requests:
      cpu: 50m
      memory: 10Mi
  command: ['sh', '-c', 'until nslookup {{.MasterAddr}}; do echo waiting for master; sleep 2; done;']
"""
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected",
                      "secret"}


def restricted_violations(pod: dict) -> list[str]:
    """What Pod Security "restricted" (Kubernetes' pod security standards, v1.25+) refuses in a pod spec."""
    spec, found = pod["spec"], []
    context = spec.get("securityContext", {})
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            found.append(key)
    found += [f"volume {v['name']}" for v in spec.get("volumes", []) if not set(v) - {"name"} <= RESTRICTED_VOLUMES]
    for container in spec.get("initContainers", []) + spec["containers"]:
        own, name = container.get("securityContext", {}), container["name"]
        if own.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation")
        capabilities = own.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []) or set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: capabilities")
        if not own.get("runAsNonRoot", context.get("runAsNonRoot")):
            found.append(f"{name}: runAsNonRoot")
        if own.get("runAsUser", context.get("runAsUser")) == 0:
            found.append(f"{name}: runAsUser 0")
        seccomp = own.get("seccompProfile", context.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccompProfile")
    return found


def operator_worker(init_template: str) -> dict:
    """A Worker pod as the Training Operator renders it: our template, and its init container from ``template``
    (rendered as its Go template is)."""
    settings = ClusterSettings(image="reg/cloob:cuda", job_workdir="s3://w", nodes=2)
    body = trainjob.manifest(settings, "cloob-train-x", trainjob.job_config(CloobConfig(), "s3://d", "s3://w/x"),
                             "s3://w/x")
    template = json.loads(json.dumps(body["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]))
    rendered = (init_template.replace("{{.InitContainerImage}}", "registry.example/busybox:1.36")
                .replace("{{.MasterAddr}}", "cloob-train-x-master-0").replace("{{.MaxTries}}", "100"))
    template["spec"]["initContainers"] = yaml.safe_load(rendered)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "cloob-train-x-worker-0", **template["metadata"]},
            "spec": template["spec"]}


def test_a_worker_as_the_operator_renders_it_is_admitted_under_restricted_with_our_init_template():
    """The operator adds `init-pytorch` to every Worker: its built-in one has no securityContext, so "restricted"
    refuses the Workers (docs said they were admitted). With infra/k8s/training-operator's template the whole pod
    passes, and it is a valid core Pod."""
    # the pod's own context gives it a non-root user and seccomp; escalation and capabilities are per container
    assert restricted_violations(operator_worker(OPERATOR_INIT_TEMPLATE)) == [
        "init-pytorch: allowPrivilegeEscalation", "init-pytorch: capabilities"]
    out = subprocess.run([tool("kubectl"), "kustomize", str(INFRA / "k8s" / "training-operator")],
                         capture_output=True, text=True, check=True).stdout
    (config_map,) = [doc for doc in yaml.safe_load_all(out) if doc]
    assert config_map["metadata"]["namespace"] == "kubeflow"
    worker = operator_worker(config_map["data"]["initContainer.yaml"])
    assert restricted_violations(worker) == []
    validator().validate(worker, K8S_VERSION, strict=True)
    validator().validate(config_map, K8S_VERSION, strict=True)


def test_every_monitoring_resource_carries_the_label_prometheus_selects_by(rendered):
    """kube-prometheus-stack's Prometheus picks only PodMonitors, ServiceMonitors and PrometheusRules labelled
    with its release: without it nothing is scraped and no rule loads, in silence. One component sets it for all."""
    _, documents = rendered
    monitoring = [doc for doc in documents if doc["apiVersion"].startswith("monitoring.coreos.com")]
    assert len(monitoring) == 4
    assert all(doc["metadata"]["labels"]["release"] == "kube-prometheus-stack" for doc in monitoring)


@pytest.mark.parametrize("kind, release", [("pytorchjob", "v2.3"), ("trainjob", "v2.1"), ("trainjob", "v2.3")])
def test_no_namespace_wide_budget_blocks_drains_and_every_training_pod_keeps_consolidation_away(rendered, kind,
                                                                                                 release):
    """Before, the PodDisruptionBudget cloob-training (maxUnavailable 0) selected every training pod: for pods no
    built-in controller owns Kubernetes takes only an integer minAvailable, so a PyTorchJob's budget followed its
    Worker replicas and the Argo- and Job-owned pods' budget failed its sync, which allows no eviction and blocked
    drains and node upgrades for up to 7 days. Now the pods carry Karpenter's and the cluster autoscaler's
    do-not-disrupt annotations, and a budget is per job, on request (tests/test_trainjob.py)."""
    _, documents = rendered
    assert not by_kind(documents, "PodDisruptionBudget")
    settings = ClusterSettings(image="i", job_workdir="s3://w", nodes=2, job_kind=kind, trainer_release=release)
    body = trainjob.manifest(settings, "n", trainjob.job_config(CloobConfig(), "s3://d", "s3://w"), "s3://w")
    spec = body["spec"]
    metas = [replica["template"]["metadata"] for replica in spec.get("pytorchReplicaSpecs", {}).values()] + \
        [override["metadata"] for override in spec.get("podTemplateOverrides", [])] + \
        [job["template"]["spec"]["template"]["metadata"] for patch in spec.get("runtimePatches", [])
         for job in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]]
    assert metas and all(meta["annotations"].items() >= trainjob.DO_NOT_DISRUPT.items() for meta in metas)


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus is not installed")
def test_prometheus_discovers_rank_0_of_a_trainjob_and_a_pytorchjob_master_through_the_monitors(rendered, tmp_path):
    """The rendered PodMonitors, as the Prometheus Operator turns them into scrape configurations, run by the real
    Prometheus on a TrainJob's and a PyTorchJob's pods as their operators make them (their targets as its pod
    discovery makes them: tests/pod_discovery.py). A TrainJob's node container declares only Trainer's port 29500
    (its torch plugin): before, cloob-trainjob's `portNumber: 9401` kept no target, so every cloob_train_* alert
    was blind on TrainJob runs."""
    from pod_discovery import active_targets, pod, scrape_config, target_groups

    monitors = {doc["metadata"]["name"]: doc for doc in by_kind(rendered[1], "PodMonitor")}
    train, operator_label = dict(trainjob.PART_OF), trainjob.POD_JOB_LABEL["pytorchjob"]
    node = {"name": "node", "image": "cloob:cuda", "ports": [{"containerPort": 29500, "protocol": "TCP"}]}
    pods = [  # Trainer's JobSet: the node job's pods, rank = completion index; an initializer's init container
        pod("cloob-train-r-node-0-0-x7k2p", "team-a", "10.4.0.7",
            {**train, "jobset.sigs.k8s.io/jobset-name": "cloob-train-r", "batch.kubernetes.io/job-completion-index":
             "0"}, [node], {"batch.kubernetes.io/job-completion-index": "0"},
            init_containers=[{"name": "wait", "image": "busybox"}]),
        pod("cloob-train-r-node-0-1-q9z4m", "team-a", "10.4.0.8",
            {**train, "jobset.sigs.k8s.io/jobset-name": "cloob-train-r"}, [node],
            {"batch.kubernetes.io/job-completion-index": "1"}),
        # the Training Operator's PyTorchJob: the Master declares the metrics port, a Worker none
        pod("cloob-train-p-master-0", "team-a", "10.4.1.2", {**train, operator_label: "cloob-train-p"},
            [{"name": "pytorch", "image": "cloob:cuda",
              "ports": [{"name": "metrics", "containerPort": 9401, "protocol": "TCP"},
                        {"name": "pytorchjob-port", "containerPort": 23456, "protocol": "TCP"}]}]),
        pod("cloob-train-p-worker-0", "team-a", "10.4.1.3", {**train, operator_label: "cloob-train-p"},
            [{"name": "pytorch", "image": "cloob:cuda"}]),
    ]
    before = json.loads(json.dumps(monitors["cloob-trainjob"]))  # the monitor as it was
    before["metadata"]["name"] = "cloob-trainjob-before"
    rank_0 = before["spec"]["podMetricsEndpoints"][0]["relabelings"][:1]
    before["spec"]["podMetricsEndpoints"][0] = {"portNumber": 9401, "path": "/metrics", "interval": "30s",
                                                "relabelings": rank_0}
    discovered = tmp_path / "pods.json"
    discovered.write_text(json.dumps(target_groups(pods)))
    configs = [scrape_config(monitor, discovered) for monitor in
               (monitors["cloob-trainjob"], monitors["cloob-training"], before)]
    found = active_targets(configs, tmp_path, expect={configs[0]["job_name"], configs[1]["job_name"]})
    (trainjob_target,) = found[configs[0]["job_name"]]
    assert trainjob_target["scrapeUrl"] == f"http://10.4.0.7:{ClusterSettings().metrics_port}/metrics"
    assert trainjob_target["labels"]["pod"] == "cloob-train-r-node-0-0-x7k2p"
    assert trainjob_target["labels"]["container"] == "node" and trainjob_target["labels"]["namespace"] == "team-a"
    (master,) = found[configs[1]["job_name"]]
    assert master["scrapeUrl"] == "http://10.4.1.2:9401/metrics" and master["labels"]["endpoint"] == "metrics"
    assert found[configs[2]["job_name"]] == []  # the monitor before: blind
