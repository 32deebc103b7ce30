"""What the planner says when a trainer's tensors do not fit an engine's: a line per tensor while there are a few,
then one line for the rest, naming the likely cause and the option that changes it."""

from __future__ import annotations

from collections import Counter

SHOWN = 5  # tensors named one by one per kind of problem


def missing(names: list[tuple[str, str]], sources: int, destinations: int, common: int) -> list[str]:
    """Lines for tensors the destination needs and no source holds (``(name, hint)``); ``sources``,
    ``destinations``, ``common``: how many tensors each side has, and both."""
    names = sorted(names, key=lambda nh: not nh[1])  # those with a hint first (stable: by name within)
    lines = [f"{name}: needed by the destination but held by no source{hint}" for name, hint in names[:SHOWN]]
    if len(names) > SHOWN:
        lines.append(
            f"... and {len(names) - SHOWN} more tensors the destination needs are held by no source: are the trainer "
            f"and the engine the same model? (the trainer has {sources} tensors, the engine {destinations}, "
            f"{common} of them alike by name)"
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
