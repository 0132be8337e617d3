"""Beyond one GPU: communicators, tensor-parallel Linear and expert-parallel MoE.

>>> import fp4kit.distributed as dist
>>> comm = dist.init()        # from `python -m fp4kit.distributed.launch`; world size 1 otherwise (no NCCL)
>>> up = dist.ColumnParallelLinear.from_float(w_up, comm, gather_output=False)
>>> down = dist.RowParallelLinear.from_float(w_down, comm)
>>> moe = dist.ExpertParallelMoE.shard(full_moe, comm)   # or ExpertParallelMoE.from_float(..., comm)

NCCL is imported lazily (`fp4kit.distributed.nccl_lib`): the numpy backend, the simulated group and
world size 1 never need it.
"""

from .comm import Communicator, LocalCommunicator, NcclCommunicator, SimulatedCommunicator, SimulatedGroup
from .env import init, shutdown
from .expert_parallel import ExpertParallelMoE, expert_range
from ..runtime.status import EP_CAPACITY_OVERFLOW  # re-exported: the flag this package records
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear

__all__ = [
    "EP_CAPACITY_OVERFLOW",
    "ColumnParallelLinear",
    "Communicator",
    "ExpertParallelMoE",
    "LocalCommunicator",
    "NcclCommunicator",
    "RowParallelLinear",
    "SimulatedCommunicator",
    "SimulatedGroup",
    "expert_range",
    "init",
    "shutdown",
]
