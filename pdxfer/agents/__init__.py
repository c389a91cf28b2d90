"""Endpoints in processes of their own, over pools holding byte patterns: an ``Agent`` (a
spawned process driven over a pipe), the commands it serves and the patterns it checks.
``pdxfer transfer-demo`` runs on them; the tests and benchmarks drive the same agents.

Within the library only ``pdxfer.cli`` imports it. Reading order: pdxfer/agents/README.md.
"""
