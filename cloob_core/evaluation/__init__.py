"""``cloob eval``: zero-shot, linear probe, retrieval and the paper's embedding diagnostics."""
