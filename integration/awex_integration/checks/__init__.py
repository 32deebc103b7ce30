"""Checks against the engines' own code: learned layouts against the tables, SGLang's model classes, Megatron-core
0.12's GroupedMLP, whether vLLM still needs each fixup."""
