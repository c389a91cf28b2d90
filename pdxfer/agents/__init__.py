"""The demos (``pdxfer transfer-demo``, ``pdxfer demo --engine vllm``) and what they run on:
agent processes holding endpoints over patterned pools, the small local model, vLLM servers.

Shipped in the wheel; only ``pdxfer.cli`` imports it from the library. Tests and benchmarks
drive their endpoints through the same ``Agent``. Reading order: pdxfer/agents/README.md.
"""
