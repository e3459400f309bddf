"""Kubeflow Pipelines components: one per stage, each a thin caller of the stage in ``cloob_core``."""
