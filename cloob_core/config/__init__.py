"""Typed configuration, in one place: one tree (:class:`CloobConfig`), one module per concern. ``params.yaml`` is
the DVC view of it; its values are these defaults.

- ``base``: what every section shares (the section model, :class:`ConfigError`, one-line validation errors);
- ``data``: preprocessing, acquiring, downloading, the engine, the gate;
- ``curation``: the filters of `cloob data curate`;
- ``train``: the model, the objective, the optimiser, ``train``;
- ``eval``: the evaluation suite and its vocabulary;
- ``promote``: the promotion gate;
- ``cluster``: where the Kubeflow pipeline runs (fixed when it is compiled, not a section of the run's tree);
- ``root``: the tree and the named recipes (``--preset``); ``loading``: a configuration from its layers.

Each default that comes from the paper says where (Fürst et al. 2022, "CLOOB"). A config file or an override
that names an unknown key, or gives a value of the wrong type or out of range, fails with the key's path. Nothing
here imports torch.
"""

from cloob_core.config.base import ConfigError, describe
from cloob_core.config.curation import CurationConfig
from cloob_core.config.data import (
    SECRET_QUERY_PARAMS,
    AcquireConfig,
    DownloadConfig,
    EngineConfig,
    PreprocessConfig,
    ValidationConfig,
)
from cloob_core.config.eval import (
    PACKAGED_SETS,
    PACKAGED_SOURCES,
    SUITE_RESULT,
    TASK_RESULTS,
    AggregateConfig,
    DatasetConfig,
    EvalConfig,
    SplitsConfig,
    TaskName,
    result_name,
)
from cloob_core.config.loading import (
    ConfigLayers,
    Values,
    config_from_mapping,
    config_from_text,
    dump_defaults,
    load_config,
    load_layers,
)
from cloob_core.config.promote import PromoteConfig
from cloob_core.config.root import PRESETS, CloobConfig
from cloob_core.config.train import (
    CPU_DATA_STREAMS,
    ModelConfig,
    ObjectiveConfig,
    OptimConfig,
    ShardSource,
    TrainConfig,
)

__all__ = [
    "CPU_DATA_STREAMS", "PACKAGED_SETS", "PACKAGED_SOURCES", "PRESETS", "SECRET_QUERY_PARAMS", "SUITE_RESULT",
    "TASK_RESULTS", "AcquireConfig", "AggregateConfig", "CloobConfig", "ConfigError", "ConfigLayers", "CurationConfig",
    "DatasetConfig",
    "DownloadConfig", "EngineConfig", "EvalConfig", "ModelConfig", "ObjectiveConfig", "OptimConfig",
    "PreprocessConfig", "PromoteConfig", "ShardSource", "SplitsConfig", "TaskName", "TrainConfig",
    "ValidationConfig", "Values", "config_from_mapping", "config_from_text", "describe", "dump_defaults",
    "load_config", "load_layers", "result_name",
]
