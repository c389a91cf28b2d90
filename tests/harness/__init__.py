"""The test harness: hosts on network namespaces, attack and flood helpers, agent commands for
tiers and transports, the model families, ZMQ contexts. Lives with the tests, not in the wheel;
``benchmarks`` imports it from a checkout. Reading order: tests/harness/README.md."""
