"""awex.meta: the metadata model, the transfer planner and the MetaServer of Awex. No torch needed.

Typical use::

    from awex.meta import canonical_tensors, load_config, plan_transfers
    from awex.meta.layouts import MegatronParallel, VllmParallel, megatron_layout, vllm_layout

    tensors = canonical_tensors(load_config("config.json"))
    trainer = megatron_layout(tensors, MegatronParallel(tp=2, dp=2))
    engine = vllm_layout(tensors, VllmParallel(tp=1), instance="vllm-0")
    plan = plan_transfers([trainer], [engine])
    for step in plan.schedule(plan.rank("trainer", 0).rank):
        ...
"""

from awex.meta.box import Box
from awex.meta.errors import AwexError, AwexValueError
from awex.meta.layout import (
    ExplicitSharding,
    Layout,
    Mesh,
    MeshSharding,
    Pin,
    Replicate,
    Shard,
    TensorLayout,
)
from awex.meta.models import ARCHITECTURES, CanonicalTensor, UnknownModelError, canonical_tensors, load_config
from awex.meta.plan import Bucket, Plan, PlanStats, Step, Transfer
from awex.meta.planner import PlanError, PlanOptions, plan_transfers
from awex.meta.quant import Fp8BlockQuant, quantize_layout, sender_quant
from awex.meta.serialize import SCHEMA_VERSION, SchemaError, dumps_json, from_wire, loads_json, to_wire
from awex.meta.spec import RankDescriptor, Role, TensorSpec
from awex.meta.topology import Estimate, Topology, estimate_seconds
from awex.meta.verify import CoverageReport, verify_plan

__version__ = "0.1.0"

__all__ = [
    "ARCHITECTURES",
    "SCHEMA_VERSION",
    "AwexError",
    "AwexValueError",
    "Box",
    "Bucket",
    "CanonicalTensor",
    "CoverageReport",
    "Estimate",
    "ExplicitSharding",
    "Fp8BlockQuant",
    "Layout",
    "Mesh",
    "MeshSharding",
    "Pin",
    "Plan",
    "PlanError",
    "PlanOptions",
    "PlanStats",
    "RankDescriptor",
    "Replicate",
    "Role",
    "SchemaError",
    "Shard",
    "Step",
    "TensorLayout",
    "TensorSpec",
    "Topology",
    "Transfer",
    "UnknownModelError",
    "canonical_tensors",
    "dumps_json",
    "estimate_seconds",
    "from_wire",
    "load_config",
    "loads_json",
    "plan_transfers",
    "quantize_layout",
    "sender_quant",
    "to_wire",
    "verify_plan",
]
