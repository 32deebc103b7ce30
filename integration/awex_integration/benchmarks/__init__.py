"""Benchmarks and measurements: the GPU benchmark and its baselines, the planner's estimates against it, the GPU test
ranks, CPU benchmarks, delta steps, checksum, learning and re-binding costs, cluster dry runs."""
