"""The mesh: D replicas × P stages of sans-IO workers, their schedules, links and drivers."""

from meshlearn.mesh.compute import DEVICES, ComputeConfig, ComputeModel, StageShape, forward_flops
from meshlearn.mesh.messages import Message
from meshlearn.mesh.network import Link, LinkProfile, Network, ring_allreduce_s
from meshlearn.mesh.report import StepReport
from meshlearn.mesh.schedule import Action, AsyncPlan, FlushPlan, format_table, schedule_table
from meshlearn.mesh.sim import SimDriver
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.mesh.worker import StepWork, Worker

__all__ = [
    "DEVICES",
    "FlushPlan",
    "Action",
    "AsyncPlan",
    "ComputeConfig",
    "ComputeModel",
    "Link",
    "LinkProfile",
    "MeshShape",
    "Message",
    "Network",
    "SimDriver",
    "StageShape",
    "StepReport",
    "StepWork",
    "Worker",
    "WorkerId",
    "forward_flops",
    "format_table",
    "ring_allreduce_s",
    "schedule_table",
]
