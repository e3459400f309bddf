"""The promotion gate's section (``promote``)."""

from __future__ import annotations

from pydantic import Field

from cloob_core.config.base import _Section


class PromoteConfig(_Section):
    """``cloob promote``: the gate between a retrained model and production."""

    store: str = Field("models/registry", description="Model store: a local folder or an s3:// prefix holding "
                       "production.json (the pointer), models/<id>/ and history/.")
    metric: str = Field("suite.retrieval_recall@5", description="The metric that must improve, as RESULT.KEY of the "
                        "evaluation report's metrics.json: suite.<aggregate> or <data set>_<result>.<key> of "
                        "the eval suite.")
    min_improvement: float = Field(0.005, ge=0.0, description="Least improvement of `metric` over production "
                                   "(0.005 = half a point of accuracy).")
    guards: dict[str, float] = Field(
        default_factory=lambda: {"suite.linear_probe_acc1": 0.01},
        description="Metrics that may not regress by more than their tolerance (RESULT.KEY: tolerance). Keys ending "
        "in _rank count lower as better.")
    min_first: dict[str, float] = Field(
        default_factory=lambda: {"suite.retrieval_recall@5": 0.10},
        description="Floors a first production model must reach (RESULT.KEY: least value; keys ending in _rank: "
        "most value): with no production to beat, a smoke run (a few dozen steps, suite R@5 under 5% on the "
        "packaged suite) is refused rather than promoted. Set them to what your suite's first model must reach; "
        "{} promotes any first model.")
    registry_stage: str | None = Field("prod", description="In a git repository whose dvc.yaml declares the model "
                                       "folder as an artifact, a promotion is also recorded as this GTO stage "
                                       "(DVC's model registry), once the commit holds the weights (null: no record).")
    pushgateway: str | None = Field(None, description="Prometheus Pushgateway the gate pushes each decision to "
                                    "(its time, promoted or not, the candidate and production, since when production "
                                    "holds): the alerts on no decision (a failed or missed scheduled run) and on no "
                                    "promotion read them (null: no push).")
    single_writer: bool = Field(False, description="The store ignores conditional writes (some older MinIO or Ceph "
                                "releases, some proxies) and you guarantee that one gate writes at a time (one "
                                "scheduled pipeline, no manual runs). Otherwise the gate probes the store and refuses "
                                "one that would let concurrent gates overwrite each other.")
