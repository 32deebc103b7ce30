"""The sync core: one version's route between the writer or reader and the transport, entered once per module in
order (docs/design.md): :mod:`~awex.engines.sync.manifest` (what a version is), :mod:`~awex.engines.sync.session`
(a rank's side, kept between versions), :mod:`~awex.engines.sync.places` (where every rank runs),
:mod:`~awex.engines.sync.version_plan` (the plan and transport), :mod:`~awex.engines.sync.peer_link` (what a
transport says to its peers), :mod:`~awex.engines.sync.signals` (per-version signals, one medium per plan),
:mod:`~awex.engines.sync.outcomes` (applied only when every receiver said so); below them the media
(:mod:`~awex.engines.sync.board`, :mod:`~awex.engines.sync.channel`), every MetaServer key
(:mod:`~awex.engines.sync.keys`) and the writer's background requests (:mod:`~awex.engines.sync.background`).
Internal: reached through ``awex.engines.WeightsWriter`` / ``WeightsReader``."""
