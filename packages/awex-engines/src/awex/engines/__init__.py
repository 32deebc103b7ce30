"""awex.engines: the WeightsWriter / WeightsReader that compose Awex, and bindings for training and inference
engines.

- :class:`WeightsWriter` (one per trainer rank) and :class:`WeightsReader` (one per receiving rank): a weight
  version's sync through a MetaServer, over the transport the ranks choose (``p2p``, ``ipc``, ``shm``, ``rdma``).
- :class:`SyncFailedError`: a version not applied on every receiving rank, naming who failed and why.
- :class:`TrainerSource`: one trainer rank's layout, rank and views, built alike for Megatron-core, FSDP2 and HF
  (``TrainerSource.megatron / .fsdp / .hf``); ``WeightsWriter.from_source`` makes its writer.
- Sources and receivers per engine: :mod:`awex.engines.megatron`, :mod:`awex.engines.fsdp`, :mod:`awex.engines.hf`;
  vLLM's ``awex`` weight-transfer backend (:mod:`awex.engines.vllm_backend`) and trainer engine
  (:mod:`awex.engines.vllm_trainer`). Engines themselves are optional extras: importing this package imports none.
- Where logging is not set up, its lines go to standard error at ``AWEX_LOGGING_LEVEL`` (:mod:`awex.engines.logs`).
"""

from awex.engines import logs
from awex.engines.errors import SyncFailedError
from awex.engines.reader import WeightsReader
from awex.engines.source import TrainerSource
from awex.engines.writer import WeightsWriter
from awex.meta.errors import AwexError, AwexValueError

__version__ = "0.1.0"

logs.configure()  # where logging is not set up (a Ray actor, an engine's worker): see awex.engines.logs

__all__ = ["AwexError", "AwexValueError", "SyncFailedError", "TrainerSource", "WeightsReader", "WeightsWriter"]
