"""cloob-pipelines: CLOOB (modern Hopfield retrieval + InfoLOOB) contrastive image-text pretraining."""

__version__ = "0.1.0"
