"""Awex integration harness: tiny models made locally, scenarios and benchmarks."""
