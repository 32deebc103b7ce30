"""Scenarios: a trainer layout x an inference layout x a transport x a model, run for N RL-like steps with every
received tensor checked bit for bit and greedy output compared (the runner, its arguments and result, the engines it
syncs into, references, trainer ranks, the CPU matrix, Ray and two-host launchers)."""
