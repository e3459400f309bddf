"""Curation: a crawl's shards scored by a model (`cloob data score`), then filtered, deduplicated, decontaminated
and resharded from those scores (`cloob data curate`). Scoring reads the shards as evaluation does
(:mod:`cloob_core.evaluation.image_loader`) with a model loaded as evaluation loads it
(:mod:`cloob_core.model.source`). docs/curation.md says what each filter does and what it is worth.
"""
