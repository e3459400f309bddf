"""What people watch during training (rank 0 only): a progress bar, log lines, TensorBoard scalars and
Prometheus metrics (served on ``/metrics``, and pushed to a Pushgateway for short runs)."""

from __future__ import annotations

import atexit
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cloob_core import pushgateway
from cloob_core.training.collapse import Health

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    step: int
    total_steps: int
    loss: float
    lr: float
    inv_tau: float
    samples_per_second: float
    data_seconds: float
    grad_norm: float | None
    samples: int
    data_errors: int
    health: Health  # the collapse detector's figures of the window


@dataclass(kw_only=True)
class Monitor:
    enabled: bool
    total_steps: int
    start_step: int
    output: Path
    progress: bool = True
    tensorboard: bool = True
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    pushgateway: str | None = None
    run: str = "local"  # the Pushgateway grouping key's run (pushgateway.run_label): concurrent runs keep their own
    linger_s: float = 0.0  # the final values stay up this long after close() (train.metrics_linger_s)
    _bar: Any = None
    _writer: Any = None
    _server: Any = None
    _metrics: dict[str, Any] = field(default_factory=dict)
    _registry: Any = None
    _linger_until: float = 0.0  # time.monotonic() until which the final values stay up
    _ended: bool = False

    def start(self) -> Monitor:
        if not self.enabled:
            return self
        from tqdm.auto import tqdm

        interactive = sys.stderr.isatty()
        self._bar = tqdm(total=self.total_steps, initial=self.start_step, unit="step", desc="train",
                         disable=not self.progress, dynamic_ncols=interactive, mininterval=0.2 if interactive else 30)
        if self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.output / "tensorboard"), purge_step=self.start_step or None)
        if self.metrics_port or self.pushgateway:
            self._start_prometheus()
        return self

    def _start_prometheus(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

        self._registry = registry = CollectorRegistry()
        self._metrics = {
            "steps": Counter("cloob_train_steps", "Optimiser steps taken", registry=registry),
            "samples": Counter("cloob_train_samples", "Image-text pairs trained on", registry=registry),
            "errors": Counter("cloob_train_data_errors", "Corrupt samples skipped", registry=registry),
            "loss": Gauge("cloob_train_loss", "Training loss (mean since the last update)", registry=registry),
            "lr": Gauge("cloob_train_learning_rate", "Learning rate", registry=registry),
            "rate": Gauge("cloob_train_samples_per_second", "Training throughput", registry=registry),
            "checkpoint": Gauge("cloob_train_last_checkpoint_timestamp_seconds", "Unix time of the last checkpoint",
                                registry=registry),
            "progress": Gauge("cloob_train_progress_ratio", "Steps done / steps planned", registry=registry),
            "eval": Gauge("cloob_train_eval", "Evaluation while training: a metric of the step last evaluated",
                          ["metric"], registry=registry),
            "eval_step": Gauge("cloob_train_eval_step", "The step last evaluated while training", registry=registry),
            "margin": Gauge("cloob_train_collapse_margin", "The objective's collapsed loss minus the training loss "
                            "(> 0: better than any collapsed model)", registry=registry),
            "rank": Gauge("cloob_train_effective_rank", "Effective rank (RankMe) of the centred batch embeddings",
                          ["tower"], registry=registry),
            "cosine": Gauge("cloob_train_mean_cosine", "Mean pairwise cosine of the batch embeddings", ["tower"],
                            registry=registry),
            "collapsed": Gauge("cloob_train_collapsed", "1 once the collapse detector has called the run collapsed",
                               registry=registry),
            "diverged": Gauge("cloob_train_diverged", "1 once the loss or the parameters stopped being finite (the "
                              "run then ends)", registry=registry),
            "failed": Gauge("cloob_train_failed", "1 once the run ended before its last step by a failure of its "
                            "own (not a signal): the stalled and checkpoint alerts leave its pushed group alone",
                            registry=registry),
        }
        if self.metrics_port:
            self._server, _thread = start_http_server(self.metrics_port, addr=self.metrics_host, registry=registry)
            log.info("Prometheus metrics on http://%s:%d/metrics", self.metrics_host, self.metrics_port)

    def advance(self, steps: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(steps)

    def update(self, snap: Snapshot, new_steps: int, new_samples: int, new_errors: int) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{snap.loss:.4f}", lr=f"{snap.lr:.2e}",
                                  samples_s=f"{snap.samples_per_second:.1f}", refresh=False)
        health = snap.health
        if not self.progress or not sys.stderr.isatty():
            log.info("step %d/%d loss %.4f (collapsed %.4f, margin %+.4f) rank %.1f/%.1f cosine %.3f/%.3f lr %.3e "
                     "%.1f samples/s", snap.step, snap.total_steps, snap.loss, health.collapsed_loss,
                     health.collapse_margin, health.effective_rank_image, health.effective_rank_text,
                     health.mean_cosine_image, health.mean_cosine_text, snap.lr, snap.samples_per_second)
        if self._writer is not None:
            scalars = {"loss": snap.loss, "lr": snap.lr, "inv_tau": snap.inv_tau,
                       "samples_per_second": snap.samples_per_second, "data_seconds": snap.data_seconds,
                       **health.as_dict()}
            if snap.grad_norm is not None:
                scalars["grad_norm"] = snap.grad_norm
            for name, value in scalars.items():
                self._writer.add_scalar(f"train/{name}", value, snap.step)
        if self._metrics:
            m = self._metrics
            m["steps"].inc(new_steps)
            m["samples"].inc(new_samples)
            m["errors"].inc(new_errors)
            m["loss"].set(snap.loss)
            m["lr"].set(snap.lr)
            m["rate"].set(snap.samples_per_second)
            m["progress"].set(snap.step / max(snap.total_steps, 1))
            m["margin"].set(health.collapse_margin)
            for tower in ("image", "text"):
                m["rank"].labels(tower=tower).set(getattr(health, f"effective_rank_{tower}"))
                m["cosine"].labels(tower=tower).set(getattr(health, f"mean_cosine_{tower}"))

    def collapsed(self) -> None:
        """The detector called the run collapsed: the gauge the alert CloobTrainingCollapsed reads."""
        if self._metrics:
            self._metrics["collapsed"].set(1)
            self.push()

    def evaluated(self, step: int, scalars: dict[str, float]) -> None:
        """An evaluation while training finished: its scalars at the step it evaluated."""
        if self._writer is not None:
            for name, value in scalars.items():
                self._writer.add_scalar(f"eval/{name}", value, step)
            self._writer.flush()
        if self._metrics:
            for name, value in scalars.items():
                self._metrics["eval"].labels(metric=name).set(value)
            self._metrics["eval_step"].set(step)
            self.push()

    def diverged(self, step: int, loss: float) -> None:
        """The run diverged at ``step`` and is about to end: its loss (NaN or infinite) and the gauge the alerts
        read, recorded and pushed before the process goes."""
        if self._metrics:
            self._metrics["loss"].set(loss)
            self._metrics["diverged"].set(1)
            self._metrics["progress"].set(step / max(self.total_steps, 1))
            self.push()

    def checkpointed(self) -> None:
        if self._metrics:
            self._metrics["checkpoint"].set(time.time())
            self.push()

    def push(self) -> None:
        """This run's metrics to the Pushgateway, under its own group (job cloob-train, its run, rank 0: only the
        main rank monitors), so concurrent runs do not overwrite each other."""
        if self._registry is not None:
            pushgateway.push(self.pushgateway, "cloob-train", self._registry, {"run": self.run, "rank": "0"})

    def close(self, ended: bool = False, linger: bool = True) -> None:
        """The loop is over (``ended``: the run reached its last step). The final values are pushed, and unless
        told not to ``linger`` (a run stopped by a signal) stay up for ``linger_s``: the process's exit waits for
        them (:func:`atexit`), while the run exports and publishes meanwhile, so a scrape every 30 s sees the end
        (progress 1, a diverged run's NaN) before the series go."""
        if self._bar is not None:
            self._bar.close()
        if self._writer is not None:
            self._writer.close()
        if self._metrics and not ended and linger:  # a failure (a signal's stop does not linger): its group stays
            self._metrics["failed"].set(1)  # for its alerts, but a run that ended is neither stalled nor overdue
        self.push()
        self._ended = ended
        if linger and self.linger_s > 0 and (self._server is not None or (ended and self._registry is not None)):
            self._linger_until = time.monotonic() + self.linger_s
            atexit.register(self.stop)
        else:
            self.stop()

    def stop(self) -> None:
        """Once the linger has passed (waited for here): stop serving /metrics and, for a run that reached its
        end, delete its Pushgateway group (a failed run's group stays: the alerts read it)."""
        atexit.unregister(self.stop)  # once: called early (a test), the exit does not wait again
        time.sleep(max(0.0, self._linger_until - time.monotonic()))
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._ended and self.linger_s > 0 and self._registry is not None:  # 0: its last push is all there is
            pushgateway.delete(self.pushgateway, "cloob-train", {"run": self.run, "rank": "0"})
