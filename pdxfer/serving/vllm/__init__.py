"""Real vLLM servers on this machine behind pdxfer's router: the small model built here,
``vllm serve`` processes with ``PdxferConnector``, and ``pdxfer demo --engine vllm``.

Starts vLLM as processes and never imports it (engine imports stay in
``pdxfer/integrations/``). Reading order: pdxfer/serving/vllm/README.md.
"""
