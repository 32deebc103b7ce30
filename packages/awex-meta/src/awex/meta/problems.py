"""What the planner says when a trainer's tensors do not fit an engine's: a line per tensor while there are a few,
then one line for the rest, naming the likely cause and the option that changes it; two different models, one line
naming both."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence

from awex.meta.spec import TensorSpec

SHOWN = 5  # tensors named one by one per kind of problem
EMBED = "model.embed_tokens.weight"


def describe(specs: Mapping[str, TensorSpec]) -> str:
    """A model as its tensors tell it: how many, layers, vocabulary x hidden size, MLA attention, experts."""
    layers = {int(m.group(1)) for n in specs for m in [re.search(r"\.layers\.(\d+)\.", n)] if m}
    experts = {int(m.group(1)) for n in specs for m in [re.search(r"\.experts\.(\d+)\.", n)] if m}
    said = [f"{len(specs)} tensors"] + ([f"{max(layers) + 1} layers"] if layers else [])
    if EMBED in specs and len(specs[EMBED].shape) == 2:
        said.append("vocabulary {} x hidden {}".format(*specs[EMBED].shape))
    if any("kv_a_proj" in n for n in specs):
        said.append("MLA attention")
    if experts:
        said.append(f"{max(experts) + 1} experts")
    return ", ".join(said)


def missing(
    names: list[tuple[str, str]],
    sources: Mapping[str, TensorSpec],
    destinations: Mapping[str, TensorSpec],
    instances: tuple[Sequence[str], Sequence[str]] = ((), ()),
) -> list[str]:
    """Lines for tensors the destination needs and no source holds (``(name, hint)``), given each side's tensors
    and instance names: where the two share fewer than half the destination's tensors by name, one line naming
    both models; else a line per tensor while there are a few, then one for the rest."""
    common = len(sources.keys() & destinations.keys())
    if names and 2 * common < len(destinations):
        trainer = "/".join(instances[0]) or "the trainer"
        engine = "/".join(instances[1]) or "the engine"
        return [
            f"{trainer} and {engine} hold different models: {trainer} has {describe(sources)}; {engine} needs "
            f"{describe(destinations)}; {common} tensor names in common, {len(names)} that {engine} needs and "
            f"{trainer} lacks (e.g. {sorted(n for n, _ in names)[0]}): load the same model on both sides"
        ]
    names = sorted(names, key=lambda nh: not nh[1])  # those with a hint first (stable: by name within)
    lines = [f"{name}: needed by the destination but held by no source{hint}" for name, hint in names[:SHOWN]]
    if len(names) > SHOWN:
        lines.append(
            f"... and {len(names) - SHOWN} more tensors the destination needs are held by no source: are the trainer "
            f"and the engine the same model? (the trainer has {len(sources)} tensors, the engine "
            f"{len(destinations)}, {common} of them alike by name)"
        )
    return lines


def narrowed(casts: list[tuple[str, str, str]]) -> list[str]:
    """Lines for narrowing casts nobody allowed (``(name, source dtype, destination dtype)``)."""
    option = "allow it with allow_cast=(name patterns) on the writer (WeightsWriter, AwexTrainerInitInfo) or the plan"
    lines = [
        f"{name}: dtype mismatch: source {s} vs destination {d} (a narrowing cast; {option} if intended)"
        for name, s, d in casts[:SHOWN]
    ]
    if len(casts) > SHOWN:
        kinds = Counter((s, d) for _, s, d in casts[SHOWN:])
        said = ", ".join(f"{n} {s} -> {d}" for (s, d), n in sorted(kinds.items()))
        lines.append(f"... and {len(casts) - SHOWN} more narrowing casts ({said}); {option}, e.g. allow_cast=('*',)")
    return lines
