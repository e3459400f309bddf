"""A stand-in for a Kubernetes API server with the Kubeflow Training Operator (or Trainer v2) installed, on
127.0.0.1: the custom-object endpoints the kubernetes client calls (create, get, delete PyTorchJob / TrainJob).
It records every request and, like the operator, "starts the pods": each node's container command runs as a
local process in its own working folder (each pod has its own /workspace), with the environment the operator
injects (PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT, PET_NPROC_PER_NODE) and secret references
resolved from ``secrets``. The job's status conditions follow the processes, as the operator's do."""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from urllib.parse import parse_qs

from json_api_server import JsonApiServer

_PATH = re.compile(r"/apis/(?P<group>[^/]+)/(?P<version>[^/]+)/namespaces/(?P<ns>[^/]+)/(?P<plural>[^/]+)"
                   r"(?:/(?P<name>[^/]+))?")
SUCCESS = {"pytorchjobs": "Succeeded", "trainjobs": "Complete"}
_EVENTS = re.compile(r"/api/v1/namespaces/(?P<ns>[^/]+)/events")
_PODS = re.compile(r"/api/v1/namespaces/(?P<ns>[^/]+)/pods(?:/(?P<pod>[^/]+)/log)?")
# each operator's label on a job's pods, and its pods' names and container (what cloob_core.ops.trainjob reads)
POD_LABEL = {"pytorchjobs": "training.kubeflow.org/job-name", "trainjobs": "jobset.sigs.k8s.io/jobset-name"}
CONTAINER = {"pytorchjobs": "pytorch", "trainjobs": "node"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class FakeTrainingCluster(JsonApiServer):
    def __init__(self, secrets: dict[str, dict[str, str]] | None = None, run_pods: bool = True,
                 extra_env: dict[str, str] | None = None, status_faults: list[str | int] | None = None,
                 prune: Callable[[dict], dict] | None = None, unschedulable: str | None = None) -> None:
        self.secrets = secrets or {}
        self.prune = prune  # a job's CRD schema, as the API server applies it: unknown fields dropped in silence
        self.unschedulable = unschedulable  # the scheduler's FailedScheduling message: no pod of any job starts
        self.events: list[dict] = []
        self.status_faults = list(status_faults or [])  # injected, one per GET of a job, in order
        self.unstartable: dict[tuple[str, str, str], str] = {}  # jobs whose pods cannot start, and why
        self.run_pods = run_pods
        self.extra_env = extra_env or {}
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.pods: dict[tuple[str, str, str], list[subprocess.Popen]] = {}
        self.logs: dict[tuple[str, str, str], list[Path]] = {}
        self.waiting: dict[tuple[str, str, str], int] = {}  # jobs whose pods stay Pending, and how many
        self._scratch = tempfile.TemporaryDirectory(prefix="fake-k8s-")
        super().__init__()

    def kubeconfig(self, path: Path, namespace: str = "team-a") -> Path:
        config = {"apiVersion": "v1", "kind": "Config", "current-context": "fake",
                  "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                  "users": [{"name": "fake", "user": {"token": "not-a-secret"}}],
                  "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake",
                                                              "namespace": namespace}}]}
        path.write_text(json.dumps(config))
        return path

    def __exit__(self, *exc: object) -> None:
        for processes in self.pods.values():
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        super().__exit__(*exc)
        self._scratch.cleanup()

    def pod_logs(self, key: tuple[str, str, str]) -> str:
        return "\n".join(path.read_text(errors="replace") for path in self.logs.get(key, []))

    # -- the operator ------------------------------------------------------------------------------------------
    def _containers(self, plural: str, body: dict) -> list[tuple[list[str], list[dict], int]]:
        """(command, env, nproc) for each node, in node-rank order."""
        spec = body["spec"]
        if plural == "pytorchjobs":
            nodes = []
            for role in ("Master", "Worker"):
                replica = spec["pytorchReplicaSpecs"].get(role)
                if replica:
                    container = replica["template"]["spec"]["containers"][0]
                    env = self._with_resources(container.get("env", []), container.get("resources", {}))
                    nodes += [(container["command"], env, int(spec["nprocPerNode"]))] * int(replica["replicas"])
            return nodes
        trainer = spec["trainer"]
        env = self._with_resources(trainer.get("env", []), trainer.get("resourcesPerNode", {}))
        return [(trainer["command"], env, int(trainer["numProcPerNode"]))] * int(trainer["numNodes"])

    @staticmethod
    def _with_resources(env: list[dict], resources: dict) -> list[dict]:
        """As the kubelet does: a ``resourceFieldRef`` to ``requests.cpu`` is the request in divisor units, rounded
        up (at least 1)."""
        resolved = []
        for entry in env:
            ref = entry.get("valueFrom", {}).get("resourceFieldRef")
            if ref is not None:
                assert ref["resource"] == "requests.cpu", ref
                request = str(resources.get("requests", {}).get("cpu", "1"))
                cores = int(request[:-1]) / 1000 if request.endswith("m") else float(request)
                entry = {"name": entry["name"], "value": str(max(1, math.ceil(cores / float(ref.get("divisor", 1)))))}
            resolved.append(entry)
        return resolved

    def _resolve(self, env: list[dict]) -> dict[str, str]:
        resolved = {}
        for entry in env:
            if "value" in entry:
                resolved[entry["name"]] = entry["value"]
                continue
            ref = entry["valueFrom"]["secretKeyRef"]
            value = self.secrets.get(ref["name"], {}).get(ref["key"])
            if value is None and not ref.get("optional"):
                raise KeyError(f"secret \"{ref['name']}\" not found (key {ref['key']})")
            if value is not None:
                resolved[entry["name"]] = value
        return resolved

    def _start(self, key: tuple[str, str, str], plural: str, body: dict) -> None:
        nodes = self._containers(plural, body)
        port = _free_port()
        processes, logs = [], []
        try:
            for _command, env, _nproc in nodes:
                self._resolve(env)
        except KeyError as err:  # as the kubelet does: the pod is not started, the job stays pending
            self.unstartable[key] = f"CreateContainerConfigError: {err.args[0]}"
            self.pods[key], self.logs[key], self.waiting[key] = [], [], len(nodes)
            return
        if self.unschedulable:  # as the scheduler does: pending pods, a Warning Event on each
            self.pods[key], self.logs[key], self.waiting[key] = [], [], len(nodes)
            for pod in self._pod_names(key, len(nodes)):
                self.events.append({"metadata": {"name": f"{pod}.1", "namespace": key[0]}, "type": "Warning",
                                    "reason": "FailedScheduling", "message": self.unschedulable,
                                    "involvedObject": {"kind": "Pod", "name": pod, "namespace": key[0]},
                                    "lastTimestamp": "2026-11-28T00:00:00Z"})
            return
        for rank, (command, env, nproc) in enumerate(nodes):
            workspace = Path(self._scratch.name, key[2], f"node-{rank}")
            workspace.mkdir(parents=True)
            image_path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # the image's python
            variables = {**os.environ, "PATH": image_path, **self.extra_env, **self._resolve(env),
                         "PET_NNODES": str(len(nodes)), "PET_NODE_RANK": str(rank), "PET_NPROC_PER_NODE": str(nproc),
                         "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port)}
            log = workspace / "pod.log"
            with open(log, "wb") as handle:
                processes.append(subprocess.Popen(command, cwd=workspace, env=variables, stdout=handle,
                                                  stderr=subprocess.STDOUT))
            logs.append(log)
        self.pods[key], self.logs[key] = processes, logs

    def _status(self, key: tuple[str, str, str], plural: str) -> dict:
        conditions = [{"type": "Created", "status": "True", "reason": "JobCreated",
                       "message": self.unstartable.get(key, "")}]
        processes = self.pods.get(key, [])
        codes = [p.poll() for p in processes]
        if any(code not in (None, 0) for code in codes):
            conditions.append({"type": "Failed", "status": "True", "reason": "PodFailed",
                               "message": f"exit codes {codes}"})
        elif processes and all(code == 0 for code in codes):
            conditions.append({"type": SUCCESS[plural], "status": "True", "reason": "JobSucceeded",
                               "message": "all pods succeeded"})
        elif processes:
            conditions.append({"type": "Running", "status": "True", "reason": "JobRunning", "message": "running"})
        return {"conditions": conditions}

    # -- HTTP ---------------------------------------------------------------------------------------------------
    def _fault(self, method: str, path: str) -> str | int | None:
        match = _PATH.fullmatch(path)
        if method == "GET" and match and match["name"] and self.status_faults:
            return self.status_faults.pop(0)
        return None

    @staticmethod
    def _pod_names(key: tuple[str, str, str], count: int) -> list[str]:
        _, plural, name = key
        if plural == "trainjobs":
            return [f"{name}-node-0-{rank}" for rank in range(count)]
        return [f"{name}-{'master' if rank == 0 else 'worker'}-{max(rank - 1, 0)}" for rank in range(count)]

    def _pod(self, key: tuple[str, str, str], name: str, status: dict) -> dict:
        return {"metadata": {"name": name, "namespace": key[0], "labels": {POD_LABEL[key[1]]: key[2]}},
                "status": status}

    def _waiting_pods(self, ns: str) -> list[dict]:
        pods = []
        for key, count in self.waiting.items():
            if key[0] != ns or key not in self.objects:
                continue
            held = self.unstartable.get(key)
            statuses = [{"name": CONTAINER[key[1]], "ready": False, "restartCount": 0, "image": "cloob",
                         "imageID": "", "state": {"waiting": {"reason": held.split(":")[0], "message": held}}}
                        ] if held else []
            pods += [self._pod(key, name, {"phase": "Pending", "containerStatuses": statuses})
                     for name in self._pod_names(key, count)]
        return pods

    def _pods(self, ns: str, pod: str | None, query: str) -> tuple[int, dict | str]:
        """The pods of the jobs, as the core API lists them (by the operator's job label) and their logs."""
        params = parse_qs(query)
        found = self._waiting_pods(ns)
        for key, processes in self.pods.items():
            plural = key[1]
            names = self._pod_names(key, len(processes))
            for rank, (pod_name, process) in enumerate(zip(names, processes, strict=True)):
                if key[0] != ns:
                    continue
                if pod == pod_name:
                    lines = self.logs[key][rank].read_text(errors="replace").splitlines()
                    tail = int(params.get("tailLines", ["0"])[0]) or len(lines)
                    return 200, "".join(f"{line}\n" for line in lines[-tail:])
                code = process.poll()
                code = 128 - code if code is not None and code < 0 else code  # killed by a signal: 128 + its number
                state = ({"running": {"startedAt": None}} if code is None else
                         {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                         "message": f"exited with {code}"}})
                found.append(self._pod(key, pod_name, {
                    "phase": "Running" if code is None else "Failed" if code else "Succeeded",
                    "containerStatuses": [{"name": CONTAINER[plural], "ready": code is None, "restartCount": 0,
                                           "image": "cloob", "imageID": "", "state": state}]}))
        if pod is not None:
            return 404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404}
        wanted = params.get("labelSelector", [""])[0]
        selected = [item for item in found if "=" in wanted and
                    item["metadata"]["labels"].get(wanted.split("=", 1)[0]) == wanted.split("=", 1)[1]]
        return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": selected}

    def _answer(self, method: str, path: str, query: str, body: dict) -> tuple[int, dict | str]:
        pods = _PODS.fullmatch(path)
        if pods and method == "GET":
            return self._pods(pods["ns"], pods["pod"], query)
        events = _EVENTS.fullmatch(path)
        if events and method == "GET":
            return 200, {"kind": "EventList", "apiVersion": "v1", "metadata": {},
                         "items": [event for event in self.events if event["metadata"]["namespace"] == events["ns"]]}
        match = _PATH.fullmatch(path)
        if not match:
            return 404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404}
        ns, plural, name = match["ns"], match["plural"], match["name"]
        if method == "POST" and name is None:
            key = (ns, plural, body["metadata"]["name"])
            if key in self.objects:
                return 409, {"kind": "Status", "status": "Failure", "reason": "AlreadyExists", "code": 409}
            if self.prune is not None and plural in SUCCESS:
                body = self.prune(body)
            self.objects[key] = body
            if self.run_pods and plural in SUCCESS:  # a training job; other objects (a Workflow) are only kept
                self._start(key, plural, body)
            return 201, body
        key = (ns, plural, name)
        if key not in self.objects:
            return 404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404}
        if method == "GET":
            if plural not in SUCCESS:
                return 200, self.objects[key]
            return 200, {**self.objects[key], "status": self._status(key, plural)}
        if method == "PATCH":  # a JSON merge patch of the metadata (what the watcher patches)
            self.objects[key]["metadata"].update(body.get("metadata", {}))
            return 200, self.objects[key]
        if method == "DELETE":
            self.waiting.pop(key, None)
            for process in self.pods.pop(key, []):
                if process.poll() is None:
                    process.kill()
                    process.wait()
            return 200, {"kind": "Status", "status": "Success"}
        return 405, {"kind": "Status", "status": "Failure", "code": 405}
