"""Observability: Triton-named Prometheus metrics per node, the statistics extension, request logs."""
