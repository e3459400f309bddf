"""cloob-pipelines: CLOOB (modern Hopfield retrieval + InfoLOOB) contrastive image-text pretraining."""

__version__ = "0.1.0"

from cloob_core.threads import limit_spinning

limit_spinning()
