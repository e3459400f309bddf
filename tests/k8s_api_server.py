"""A stand-in for a Kubernetes API server with the Kubeflow Training Operator (or Trainer v2) installed, on
127.0.0.1: the custom-object endpoints the kubernetes client calls (create, get, patch, delete PyTorchJob /
TrainJob). It records every request and, like the operator, "starts the pods": each node's container command runs
as a local process in its own working folder (each pod has its own /workspace), with the environment the operator
injects (PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT, PET_NPROC_PER_NODE) and secret references
resolved from ``secrets``. The job's status conditions follow the processes, as the operator's do.

A create is judged as the real API server judges it, in its order: the CRD's structural schema of the release
served (tests/crds; ``releases``), whose unknown fields ``fieldValidation=Strict`` refuses (HTTP 400, the
server's "strict decoding error") and any other request prunes without a word; the schema's value checks (HTTP
422); then the admission webhooks (Trainer's TrainJob validator from v2.2 on: a runtime patch's manager must be a
domain-prefixed path; ``admission`` adds one: HTTP 403 "admission webhook ... denied the request"). ``dryRun=All``
runs all of it and keeps nothing. With ``kueue``, Kueue is installed: a job that names a LocalQueue is suspended
when created (its mutating webhook), gets a Workload with no quota reserved, and is listed by the visibility API
until :meth:`admit`."""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import parse_qs

import job_schemas
from json_api_server import JsonApiServer

_PATH = re.compile(r"/apis/(?P<group>[^/]+)/(?P<version>[^/]+)/namespaces/(?P<ns>[^/]+)/(?P<plural>[^/]+)"
                   r"(?:/(?P<name>[^/]+))?")
SUCCESS = {"pytorchjobs": "Succeeded", "trainjobs": "Complete"}
KIND = {"pytorchjobs": "pytorchjob", "trainjobs": "trainjob"}
SERVED = {"pytorchjobs": "v1.9.3", "trainjobs": "v2.3.0"}  # the releases of the CRDs installed by default
TRAINER_WEBHOOK = "validator.trainjob.trainer.kubeflow.org"
_DOMAIN_PREFIXED = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/.+$")
_VISIBILITY = re.compile(r"/apis/visibility\.kueue\.x-k8s\.io/v1beta1/namespaces/(?P<ns>[^/]+)/localqueues/"
                         r"(?P<queue>[^/]+)/pendingworkloads")
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
_EVENTS = re.compile(r"/api/v1/namespaces/(?P<ns>[^/]+)/events")
_PODS = re.compile(r"/api/v1/namespaces/(?P<ns>[^/]+)/pods(?:/(?P<pod>[^/]+)/log)?")
_TOKENS = re.compile(r"/api/v1/namespaces/(?P<ns>[^/]+)/serviceaccounts/(?P<account>[^/]+)/token")
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
                 releases: dict[str, str] | None = None, strict_validation: bool = True,
                 admission: Callable[[str, dict], str | None] | None = None, kueue: bool = False,
                 unschedulable: str | None = None) -> None:
        self.secrets = secrets or {}
        self.releases = {**SERVED, **(releases or {})}  # plural -> the release of the CRD installed
        self.strict_validation = strict_validation  # False: a server before fieldValidation (it prunes in silence)
        self.admission = admission  # another validating webhook: (plural, body) -> why it denies, or None
        self.kueue = kueue
        self.workloads: dict[tuple[str, str, str], dict] = {}  # Kueue's Workload per job that names a queue
        self.tokens: list[dict] = []  # the TokenRequests answered, in order: their account, lifetime and token
        self.token_requesters: set[str] | None = None  # bearer tokens that may request them (None: any)
        self.unschedulable = unschedulable  # the scheduler's FailedScheduling message: no pod of any job starts
        self.events: list[dict] = []
        self.status_faults = list(status_faults or [])  # injected, one per GET of a job, in order
        self.workflow_faults: list[str | int] = []  # the same for the GETs of a Workflow
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

    def _job_status(self, key: tuple[str, str, str], plural: str) -> dict:
        conditions = [{"type": "Created", "status": "True", "reason": "JobCreated",
                       "message": self.unstartable.get(key, "")}]
        if self._suspended(key):  # as the operators report a suspended job
            return {"conditions": [*conditions, {"type": "Suspended", "status": "True", "reason": "JobSuspended",
                                                 "message": "the job is suspended"}]}
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
        if method != "GET" or not match or not match["name"]:
            return None
        faults = self.status_faults if match["plural"] in SUCCESS else \
            self.workflow_faults if match["plural"] == "workflows" else []
        return faults.pop(0) if faults else None

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

    # -- the API server's judgement of a create, and Kueue --------------------------------------------------------
    def _judged(self, plural: str, body: dict, strict: bool) -> tuple[int, dict] | dict:
        """A job's body as the server would store it, or its refusal: strict decoding (400), the schema's value
        checks (422), the validating webhooks (403); Kueue's mutating webhook suspends a queued job."""
        kind, release = KIND[plural], self.releases[plural]
        info, name = job_schemas.crd(kind, release), body.get("metadata", {}).get("name", "")
        unknown = job_schemas.unknown_fields(kind, release, body)
        if strict and unknown:
            return 400, _status(400, "BadRequest", f'{info["kind"]} in version "{info["version"]}" cannot be handled '
                                f'as a {info["kind"]}: strict decoding error: '
                                + ", ".join(f'unknown field "{path}"' for path in unknown))
        body = job_schemas.pruned(kind, release, body)
        if self.kueue and QUEUE_LABEL in body["metadata"].get("labels", {}):
            spec = body["spec"]
            (spec.setdefault("runPolicy", {}) if plural == "pytorchjobs" else spec)["suspend"] = True
        invalid = [error for error in job_schemas.errors(kind, release, body) if not error.startswith("unknown")]
        if invalid:
            return 422, _status(422, "Invalid", f'{info["kind"]}.{info["group"]} "{name}" is invalid: '
                                + "; ".join(invalid))
        for webhook, denial in ((TRAINER_WEBHOOK, self._trainer_webhook(plural, release, body)),
                                ("policy.example.com", self.admission(plural, body) if self.admission else None)):
            if denial:
                return 403, _status(403, "Forbidden", f'admission webhook "{webhook}" denied the request: {denial}')
        return body

    @staticmethod
    def _trainer_webhook(plural: str, release: str, body: dict) -> str | None:
        """Trainer's TrainJob validator (v2.2 on, plugins/jobset): each runtime patch's manager a domain-prefixed
        path, as apimachinery's IsDomainPrefixedPath words it."""
        if plural != "trainjobs" or release < "v2.2":
            return None
        errors = [f'spec.runtimePatches.manager: Invalid value: "{patch.get("manager")}": must be a domain-prefixed '
                  'path (such as "acme.io/foo")' for patch in body["spec"].get("runtimePatches", [])
                  if not _DOMAIN_PREFIXED.match(str(patch.get("manager", "")))]
        return None if not errors else errors[0] if len(errors) == 1 else f"[{', '.join(errors)}]"

    def _queue(self, key: tuple[str, str, str], body: dict) -> None:
        """Kueue's Workload for a suspended job that names a LocalQueue: quota not reserved until admitted."""
        ns, plural, name = key
        self.workloads[key] = {
            "apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "Workload",
            "metadata": {"name": f"{KIND[plural]}-{name}-{len(self.workloads):05x}", "namespace": ns,
                         "labels": {"kueue.x-k8s.io/job-uid": body["metadata"]["uid"]}},
            "spec": {"queueName": body["metadata"]["labels"][QUEUE_LABEL]},
            "status": {"conditions": [{"type": "QuotaReserved", "status": "False", "reason": "Pending",
                                       "message": "couldn't assign flavors to pod set node: insufficient unused "
                                                  "quota for nvidia.com/gpu in flavor h100, 16 more needed"}]}}

    def admit(self, key: tuple[str, str, str]) -> None:
        """As Kueue admits a queued job: quota reserved, the job unsuspended, its pods started."""
        workload = self.workloads[key]
        workload["status"]["conditions"] = [{"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved",
                                             "message": "Quota reserved in ClusterQueue cluster-gpus"},
                                            {"type": "Admitted", "status": "True", "reason": "Admitted",
                                             "message": "The workload is admitted"}]
        spec = self.objects[key]["spec"]
        (spec["runPolicy"] if key[1] == "pytorchjobs" else spec)["suspend"] = False
        if self.run_pods:
            self._start(key, key[1], self.objects[key])

    def _suspended(self, key: tuple[str, str, str]) -> bool:
        spec = self.objects[key]["spec"]
        return bool((spec.get("runPolicy", {}) if key[1] == "pytorchjobs" else spec).get("suspend"))

    def _pending_workloads(self, ns: str, queue: str) -> dict:
        queued = [(key, workload) for key, workload in self.workloads.items()
                  if key in self.objects and self._suspended(key)]
        items = [{"metadata": {"name": workload["metadata"]["name"], "namespace": key[0]},
                  "localQueueName": workload["spec"]["queueName"], "priority": 0, "positionInClusterQueue": index,
                  "positionInLocalQueue": [k for k, w in queued if w["spec"]["queueName"] == queue].index(key)}
                 for index, (key, workload) in enumerate(queued)
                 if key[0] == ns and workload["spec"]["queueName"] == queue]
        return {"kind": "PendingWorkloadsSummary", "apiVersion": "visibility.kueue.x-k8s.io/v1beta1",
                "metadata": {}, "items": items}

    # -- HTTP ---------------------------------------------------------------------------------------------------
    def _token(self, ns: str, account: str, body: dict, bearer: str | None) -> tuple[int, dict]:
        """A TokenRequest (authentication.k8s.io/v1), as the API server answers it: the token, its expiry."""
        if self.token_requesters is not None and bearer not in self.token_requesters:
            return 403, _status(403, "Forbidden", f'serviceaccounts "{account}" is forbidden: User '
                                f'"system:serviceaccount:{ns}:pipeline-runner" cannot create resource '
                                f'"serviceaccounts/token" in API group "" in the namespace "{ns}"')
        lifetime = int(body.get("spec", {}).get("expirationSeconds", 3600))
        token = f"minted-{len(self.tokens) + 1}"
        self.tokens.append({"account": f"{ns}/{account}", "lifetime": lifetime, "token": token,
                            "bound": body.get("spec", {}).get("boundObjectRef"), "by": bearer})
        expiry = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + lifetime))
        spec = {"audiences": ["https://kubernetes.default.svc.cluster.local"], **body.get("spec", {})}  # the default
        return 201, {"kind": "TokenRequest", "apiVersion": "authentication.k8s.io/v1", "metadata": {},
                     "spec": spec, "status": {"token": token, "expirationTimestamp": expiry}}

    def _answer(self, method: str, path: str, query: str, body: dict) -> tuple[int, dict | str]:
        tokens = _TOKENS.fullmatch(path)
        if tokens and method == "POST":
            return self._token(tokens["ns"], tokens["account"], body, self.requests[-1]["authorization"])
        pods = _PODS.fullmatch(path)
        if pods and method == "GET":
            return self._pods(pods["ns"], pods["pod"], query)
        events = _EVENTS.fullmatch(path)
        if events and method == "GET":
            return 200, {"kind": "EventList", "apiVersion": "v1", "metadata": {},
                         "items": [event for event in self.events if event["metadata"]["namespace"] == events["ns"]]}
        visibility = _VISIBILITY.fullmatch(path)
        if visibility and method == "GET" and self.kueue:
            return 200, self._pending_workloads(visibility["ns"], visibility["queue"])
        match = _PATH.fullmatch(path)
        if not match or (match["plural"] == "workloads" and not self.kueue):
            return 404, _status(404, "NotFound", "the server could not find the requested resource")
        ns, plural, name = match["ns"], match["plural"], match["name"]
        params = parse_qs(query)
        if method == "GET" and name is None and plural == "workloads":
            wanted = params.get("labelSelector", [""])[0]
            items = [workload for key, workload in self.workloads.items() if key[0] == ns and key in self.objects and
                     "=" in wanted and workload["metadata"]["labels"].get(wanted.split("=", 1)[0]) ==
                     wanted.split("=", 1)[1]]
            return 200, {"kind": "WorkloadList", "apiVersion": "kueue.x-k8s.io/v1beta1", "metadata": {},
                         "items": items}
        if method == "POST" and name is None:
            if plural in SUCCESS:
                strict = self.strict_validation and params.get("fieldValidation", [""])[0] == "Strict"
                judged = self._judged(plural, body, strict)
                if isinstance(judged, tuple):
                    return judged
                body = judged
            key = (ns, plural, body["metadata"]["name"])
            if key in self.objects:
                return 409, _status(409, "AlreadyExists", f'{plural} "{key[2]}" already exists')
            body = {**body, "metadata": {**body["metadata"], "namespace": ns, "uid": f"uid-{key[2]}",
                                         "creationTimestamp": "2026-12-01T00:00:00Z"}}
            if params.get("dryRun", [""])[0] == "All":  # judged, and nothing kept
                return 201, body
            self.objects[key] = body
            if plural in SUCCESS and self._suspended(key):
                if self.kueue and QUEUE_LABEL in body["metadata"].get("labels", {}):
                    self._queue(key, body)
            elif self.run_pods and plural in SUCCESS:  # a training job; other objects (a Workflow) are only kept
                self._start(key, plural, body)
            return 201, body
        key = (ns, plural, name)
        if key not in self.objects:
            return 404, _status(404, "NotFound", f'{plural} "{name}" not found')
        if method == "GET":
            if plural not in SUCCESS:
                return 200, self.objects[key]
            return 200, {**self.objects[key], "status": self._job_status(key, plural)}
        if method == "PATCH":  # a JSON merge patch of the metadata (what the watcher patches)
            self.objects[key]["metadata"].update(body.get("metadata", {}))
            return 200, self.objects[key]
        if method == "DELETE":
            self.waiting.pop(key, None)
            if plural in SUCCESS:  # the job goes once its pods have (propagationPolicy Foreground)
                uid = self.objects.pop(key)["metadata"].get("uid")
                for owned in [k for k, o in self.objects.items()  # the garbage collector: what the job owned
                              if any(ref.get("uid") == uid for ref in o["metadata"].get("ownerReferences", []))]:
                    del self.objects[owned]
            for process in self.pods.pop(key, []):
                if process.poll() is None:
                    process.kill()
                    process.wait()
            return 200, {"kind": "Status", "status": "Success"}
        return 405, _status(405, "MethodNotAllowed", "the server does not allow this method")


def _status(code: int, reason: str, message: str) -> dict:
    """A Status answer, as the API server words a failure."""
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}
