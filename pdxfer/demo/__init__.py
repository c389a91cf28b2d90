"""Test and benchmark harness: agent processes, byte patterns, the transfer demo.

Never imported by the library (only by tests, scripts and ``pdxfer.cli``). Reading order:
``patterns`` (pool geometries and byte patterns that reveal misplacement) -> ``harness``
(an ``Agent`` is one endpoint in its own process, driven over a pipe) -> ``agent`` (its
commands) -> ``bench_agent`` / ``tier_cmds`` (benchmark and tier commands) ->
``transfer_demo``.
"""
