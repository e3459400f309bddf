"""The four evaluation tasks, a module each (as CLIP_benchmark keeps them): its options (a frozen dataclass the
CLI builds from its flags), its run, its result line and its math. ``common.py`` holds what they share."""
