"""A plain HF model on one rank: it holds every canonical tensor whole."""

from __future__ import annotations

from typing import Sequence

from awex.meta.layout import Layout, Mesh, MeshSharding, TensorLayout
from awex.meta.models import CanonicalTensor
from awex.meta.spec import Role


def hf_layout(tensors: Sequence[CanonicalTensor], role: Role | str, instance: str = "hf") -> Layout:
    """One rank holding all of each tensor (an HF trainer or an HF reference receiver)."""
    mesh = Mesh("dense", (("world", 1),))
    return Layout(instance, Role(role), 1, (mesh,), tuple(TensorLayout(t.spec, MeshSharding("dense")) for t in tensors))
