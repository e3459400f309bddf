"""Kubeflow pipelines of cloob-pipelines: definitions, compilation, submission and schedules."""
