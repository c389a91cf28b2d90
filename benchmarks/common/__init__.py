"""What the benchmarks share: the runner (CLI, JSON, load), agent commands, vLLM helpers."""
