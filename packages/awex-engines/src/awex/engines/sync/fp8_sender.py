"""A trainer rank's FP8 tiles where its receivers cannot quantise what they read (``quantize_on_receive="auto"``,
:data:`awex.engines.sync.options.AUTO`): when the ranks' plan says the trainers quantise
(:class:`awex.engines.sync.version_plan.Planned` ``send_quant``), this rank sends FP8 views of its bf16 weights
(``awex.convert.Fp8Views`` over its own views, quantised to the receivers' tiles) instead of the weights, refreshed
wave by wave over p2p and all at once elsewhere. Built once per quantisation, kept while the plan lasts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from awex.meta import Box, Fp8BlockQuant, Layout, quantize_layout
from awex.transport.rebind import confirm_bound, rebound
from awex.transport.shards import LocalShards

Refresh = Callable[[], None]
ByWave = Callable[[Sequence[Sequence[tuple[str, tuple[int, ...], tuple[int, ...]]]]], Callable[[int], None]]


class _Made(NamedTuple):
    """What :meth:`Fp8Sender.views` built for one quantisation and writer's refresh."""

    quant: Fp8BlockQuant
    refresh: Refresh | None  # the writer's own
    layout: Layout  # the FP8 form of the rank's layout
    views: Any  # its awex.convert.Fp8Views (FP8 buffers of its own)
    all_at_once: Refresh
    by_wave: ByWave


class Fp8Sender:
    """What one trainer rank sends when it quantises: :meth:`views` gives the FP8 shards of its weights (re-bound
    where the weights moved) and what refreshes them, for a quantisation the plan names."""

    def __init__(self, layout: Layout, local_rank: int, view_of: Callable[[str, Box], object]):
        self.layout = layout
        self.local_rank = local_rank
        self._view_of = view_of
        self._made: _Made | None = None
        self._shards: LocalShards | None = None

    def views(self, quant: Fp8BlockQuant, refresh: Refresh | None) -> tuple[LocalShards, Refresh, ByWave]:
        """``(FP8 shards, refresh all at once, refresh by wave)`` for ``quant``; the writer's own ``refresh`` (a
        source's derived views) runs first in either. The same callables while ``quant`` and ``refresh`` stay (a
        transport keeps what it derived from a ``by_wave`` it saw before)."""
        made = self._made
        if made is None or made.quant != quant or made.refresh is not refresh:
            from awex.convert import Fp8Views

            fp8_layout = quantize_layout(self.layout, quant)
            fp8 = Fp8Views(fp8_layout, self.local_rank, self._view_of, quant)
            made = self._made = _Made(quant, refresh, fp8_layout, fp8, *_refreshers(fp8, refresh))
            self._shards = LocalShards.from_layout(fp8_layout, self.local_rank, fp8.view_of)
        # the bf16 weights' addresses: the FP8 buffers stay, what is sent unquantised follows the weights
        self._shards, _ = rebound(made.layout, self.local_rank, made.views.view_of, self._shards, quick=True)
        return self._shards, made.all_at_once, made.by_wave

    def confirm(self) -> None:
        """While the bytes move: the rest of the moved-memory check of what :meth:`views` gave
        (``confirm_bound``: a tensor that changed form at the same address fails the version, and the next
        :meth:`views` takes its views again)."""
        if self._made is not None and self._shards is not None:
            confirm_bound(self._made.layout, self.local_rank, self._made.views.view_of, self._shards)


def _refreshers(fp8, refresh: Refresh | None) -> tuple[Refresh, ByWave]:
    """``fp8``'s quantisation all at once and by wave, each after ``refresh`` where there is one."""
    if refresh is None:
        return fp8.quantize, fp8.by_wave

    def all_at_once() -> None:
        refresh()
        fp8.quantize()

    def by_wave(sent):
        quantize_wave = fp8.by_wave(sent)

        def each(i: int) -> None:
            if i == 0:
                refresh()
            quantize_wave(i)

        return each

    return all_at_once, by_wave
