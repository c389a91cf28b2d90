"""Engines meet pdxfer here: ``vllm/`` (a KV connector). The only place that imports an
engine; each integration uses only ``pdxfer``'s and ``pdxfer.tiers``' public names."""
