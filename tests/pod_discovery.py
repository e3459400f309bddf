"""A PodMonitor's targets as Prometheus makes them, without a cluster.

``scrape_config`` renders a PodMonitor endpoint into the scrape configuration the Prometheus Operator generates
for it (pkg/prometheus/promcfg.go, generatePodMonitorConfig: the running-pod filter, the selector's keep rules,
the port filter, the namespace/container/pod/job labels, then the endpoint's own relabelings), for the fields our
monitors use. ``target_groups`` is what Prometheus' Kubernetes pod discovery gives for a pod
(discovery/kubernetes/pod.go, buildPod and podLabels: a target per declared port of each container, init
containers included, and a port-free target for a container that declares none; the pod's meta labels). Debian's
Prometheus is built without its Kubernetes discovery, so those groups reach the real ``prometheus`` binary through
file discovery, and ``active_targets`` reads what its relabeling made of them."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any


def _label(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def scrape_config(monitor: dict[str, Any], targets_file: Path, index: int = 0) -> dict[str, Any]:
    """The scrape configuration the Prometheus Operator makes of ``monitor``'s endpoint ``index``, with the pods'
    discovery read from ``targets_file`` (:func:`target_groups`) in place of the Kubernetes API."""
    meta, spec = monitor["metadata"], monitor["spec"]
    endpoint = spec["podMetricsEndpoints"][index]
    namespace = meta.get("namespace", "team-a")
    relabel: list[dict[str, Any]] = [
        {"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"},
        {"source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)", "action": "drop"}]
    for key, value in sorted(spec["selector"].get("matchLabels", {}).items()):
        relabel.append({"action": "keep", "regex": f"({value});true",
                        "source_labels": [f"__meta_kubernetes_pod_label_{_label(key)}",
                                          f"__meta_kubernetes_pod_labelpresent_{_label(key)}"]})
    for expression in spec["selector"].get("matchExpressions", []):
        assert expression["operator"] == "Exists", expression  # the only operator our monitors use
        relabel.append({"action": "keep", "regex": "true",
                        "source_labels": [f"__meta_kubernetes_pod_labelpresent_{_label(expression['key'])}"]})
    if endpoint.get("port"):
        relabel.append({"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                        "regex": endpoint["port"]})
    elif endpoint.get("portNumber"):
        relabel.append({"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_number"],
                        "regex": str(endpoint["portNumber"])})
    relabel += [{"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
                {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                {"target_label": "job", "replacement": f"{namespace}/{meta['name']}"}]
    if endpoint.get("port"):
        relabel.append({"target_label": "endpoint", "replacement": endpoint["port"]})
    names = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    for rule in endpoint.get("relabelings", []):
        relabel.append({names.get(key, key): value for key, value in rule.items()})
    return {"job_name": f"podMonitor/{namespace}/{meta['name']}/{index}", "honor_labels": False,
            "file_sd_configs": [{"files": [str(targets_file)]}],
            "scrape_interval": endpoint.get("interval", "30s"), "metrics_path": endpoint.get("path", "/metrics"),
            "relabel_configs": relabel}


def _meta(name: str) -> str:
    return "__meta_kubernetes_" + name


def target_groups(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The target groups of Prometheus' pod discovery for ``pods`` (one file-discovery group per target)."""
    groups = []
    for item in pods:
        meta, spec, status = item["metadata"], item["spec"], item["status"]
        if not status.get("podIP"):  # starting or evicted: no targets
            continue
        ready = next((c["status"].lower() for c in status.get("conditions", []) if c["type"] == "Ready"), "unknown")
        labels = {_meta("namespace"): meta["namespace"], _meta("pod_name"): meta["name"],
                  _meta("pod_ip"): status["podIP"], _meta("pod_ready"): ready, _meta("pod_phase"): status["phase"],
                  _meta("pod_node_name"): spec.get("nodeName", ""), _meta("pod_host_ip"): status.get("hostIP", ""),
                  _meta("pod_uid"): meta.get("uid", "")}
        for kind, values in (("label", meta.get("labels", {})), ("annotation", meta.get("annotations", {}))):
            for key, value in values.items():
                labels[_meta(f"pod_{kind}_{_label(key)}")] = value
                labels[_meta(f"pod_{kind}present_{_label(key)}")] = "true"
        containers = [(c, False) for c in spec.get("containers", [])] + \
            [(c, True) for c in spec.get("initContainers", [])]
        for container, init in containers:
            own = {_meta("pod_container_name"): container["name"], _meta("pod_container_image"): container["image"],
                   _meta("pod_container_id"): "", _meta("pod_container_init"): str(init).lower()}
            ports = container.get("ports") or []
            if not ports:
                groups.append({"targets": [status["podIP"]], "labels": {**labels, **own}})
            for port in ports:
                groups.append({"targets": [f"{status['podIP']}:{port['containerPort']}"], "labels": {
                    **labels, **own, _meta("pod_container_port_number"): str(port["containerPort"]),
                    _meta("pod_container_port_name"): port.get("name", ""),
                    _meta("pod_container_port_protocol"): port.get("protocol", "TCP")}})
    return groups


def pod(name: str, namespace: str, ip: str, labels: dict[str, str], containers: list[dict[str, Any]],
        annotations: dict[str, str] | None = None, init_containers: list[dict[str, Any]] | None = None
        ) -> dict[str, Any]:
    """A running pod as the API server lists it."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", "resourceVersion": "100",
                         "labels": labels, "annotations": annotations or {}},
            "spec": {"containers": containers, "initContainers": init_containers or [], "nodeName": "gpu-node-1"},
            "status": {"phase": "Running", "podIP": ip, "hostIP": "10.0.0.1",
                       "conditions": [{"type": "Ready", "status": "True"}]}}


def active_targets(scrape_configs: list[dict[str, Any]], workdir: Path, expect: set[str],
                   settle_s: float = 45.0) -> dict[str, list[dict[str, Any]]]:
    """Run ``prometheus`` on ``scrape_configs`` until each job of ``expect`` has an active target (then a few
    seconds more, for the jobs that may find none), or fail after ``settle_s``; every job's active targets, as its
    /api/v1/targets lists them."""
    import yaml

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump({"global": {"scrape_interval": "1h"}, "scrape_configs": scrape_configs}))
    log = workdir / "prometheus.log"
    with open(log, "wb") as errors:
        process = subprocess.Popen(["prometheus", f"--config.file={config}",
                                    f"--storage.tsdb.path={workdir / 'tsdb'}",
                                    f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                                   stderr=errors)
    jobs = [config["job_name"] for config in scrape_configs]

    def targets() -> dict[str, list[dict[str, Any]]]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/targets", timeout=5) as answer:
            active = json.load(answer)["data"]["activeTargets"]
        return {job: [target for target in active if target["scrapePool"] == job] for job in jobs}

    try:
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                found = targets()
            except OSError:
                continue
            if all(found[job] for job in expect):
                time.sleep(3.0)  # the other jobs' discovery of the same pods
                return targets()
        raise AssertionError(f"prometheus found no target for {sorted(expect)} in {settle_s:.0f} s: "
                             f"{log.read_text(errors='replace')[-2000:]}")
    finally:
        process.terminate()
        process.wait(timeout=30)
