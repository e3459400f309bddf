"""What a cluster says of the training job a compiled pipeline would submit, before a run holds any GPU.

The job body is built as the multi-node step builds it (the same settings, the run's configuration) and created
with ``dryRun=All`` and strict field validation: the API server decodes it against the installed CRD (an
unknown field is an error, not a silent prune), runs the CRD's validation and every admission webhook (Trainer's
validator, Kueue's, a policy engine's) and keeps nothing. What it answered is the verdict, in its words. The body
it would have stored is read back too, for a server that ignores strict validation (before Kubernetes 1.27).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from cloob_core import storage
from cloob_core.config import CloobConfig
from cloob_core.config.cluster import ClusterSettings
from cloob_core.errors import StageError
from cloob_core.ops import trainjob


class PreflightFailed(StageError):
    """The cluster refused the job a run would submit: the run would fail at its training step."""

    exit_code = 1


@dataclass(frozen=True)
class JobVerdict:
    """The API server's answer to one job body's dry run."""

    kind: str
    namespace: str
    name: str
    admitted: bool
    said: str  # the refusal in the server's words, or what it would have kept
    dropped: list[str] = field(default_factory=list)  # fields the server would prune (a non-strict server)

    def line(self) -> str:
        where = f"{self.kind} {self.namespace}/{self.name}"
        if not self.admitted:
            return f"{where}: refused: {self.said}"
        if self.dropped:
            return f"{where}: admitted, but the server would drop {len(self.dropped)} field(s) " \
                   f"({', '.join(self.dropped[:5])}): {self.said}"
        return f"{where}: admitted ({self.said})"


def preflight(settings: ClusterSettings, config: CloobConfig, shards: str, namespace: str | None = None,
              api: Any = None) -> list[JobVerdict]:
    """The dry run of the job body a run with ``settings`` and ``config`` would submit, reading ``shards``, in
    ``namespace`` (default: ``job_namespace``, else the kubeconfig context's, as the step's pod would use its own);
    none for a pipeline that trains on one node (a KFP step, no job). Raises :class:`PreflightFailed` when the
    cluster refused it, with the verdict's line."""
    if settings.nodes == 1:
        return []
    if api is None:
        api, _ = trainjob._apis()
    name = trainjob.job_name(f"preflight-{secrets.token_hex(4)}")  # a dry run keeps nothing: any free name
    workdir = storage.join(settings.job_workdir, name)
    job = trainjob.job_config(config, shards, workdir, settings.gpus, settings.metrics_port)
    body = trainjob.manifest(settings, name, job, workdir)
    where = namespace or settings.job_namespace or trainjob.current_namespace()
    kind = body["kind"]
    try:
        stored = trainjob.create_job(api, body, where, settings, dry_run=True)
    except trainjob.JobRefused as err:  # in the server's words: the preflight's own account is not the step's
        verdict = JobVerdict(kind, where, name, False, f"HTTP {err.status}: {err.said}")
        raise PreflightFailed(verdict.line()) from None
    dropped = trainjob.missing_fields({"metadata": {"labels": body["metadata"]["labels"]}, "spec": body["spec"]},
                                      stored or {})
    group, version, _, _ = trainjob.KINDS[settings.job_kind]
    said = f"{group}/{version}, {settings.nodes} node(s) x {settings.gpus} GPU(s); the dry run passed the CRD's " \
           "schema with strict field validation and the admission webhooks"
    verdict = JobVerdict(kind, where, name, True, said, dropped)
    if dropped:
        raise PreflightFailed(verdict.line() + f". {trainjob.schema_hint(settings)}")
    return [verdict]
