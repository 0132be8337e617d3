"""The launcher's environment contract and `init`, which turns it into a communicator.

`fp4kit.distributed.launch` sets, in every child:

* ``FP4KIT_RANK``, ``FP4KIT_WORLD_SIZE``, ``FP4KIT_LOCAL_RANK``;
* ``FP4KIT_DEVICE``: the CUDA device index this rank uses (0 when the launcher isolates each
  rank with ``CUDA_VISIBLE_DEVICES``);
* ``FP4KIT_RENDEZVOUS``: a directory where rank 0 publishes the NCCL unique id (a file written
  atomically) and the other ranks read it;
* ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1``:
  NVLink multicast stays off (nothing in fp4kit creates multicast objects either).
"""

from __future__ import annotations

import json
import os
import time

from .comm import Communicator, LocalCommunicator, NcclCommunicator

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
RANK, WORLD_SIZE, LOCAL_RANK, DEVICE, RENDEZVOUS = (
    "FP4KIT_RANK", "FP4KIT_WORLD_SIZE", "FP4KIT_LOCAL_RANK", "FP4KIT_DEVICE", "FP4KIT_RENDEZVOUS")
ID_FILE = "nccl_unique_id.json"


def _int_env(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}: expected an integer, got {value!r}") from None


def publish_unique_id(directory: str, unique_id) -> None:
    """Rank 0: write the id so that a reader never sees a partial file (write, then rename)."""
    tmp = os.path.join(directory, ID_FILE + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump([int(v) for v in unique_id], f)
    os.replace(tmp, os.path.join(directory, ID_FILE))


def read_unique_id(directory: str, *, timeout: float = 300.0, poll: float = 0.05) -> tuple:
    """Other ranks: wait for rank 0's id (TimeoutError naming the directory after ``timeout`` s)."""
    path = os.path.join(directory, ID_FILE)
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{RENDEZVOUS}: no NCCL unique id appeared in {directory!r} within {timeout:.0f} s "
                               "(did rank 0 start and reach fp4kit.distributed.init()?)")
        time.sleep(poll)
    with open(path) as f:
        return tuple(json.load(f))


def init(*, timeout: float | None = None) -> Communicator:
    """The communicator of this process.

    Not started by `fp4kit.distributed.launch` (no ``FP4KIT_WORLD_SIZE``) or world size 1: a
    `LocalCommunicator` (no NCCL, no device selected). Otherwise: selects ``FP4KIT_DEVICE`` as
    CuPy's current device, exchanges the NCCL unique id through ``FP4KIT_RENDEZVOUS``, and returns
    an `NcclCommunicator` after one warm-up all-reduce (which also checks that every rank joined).
    """
    world = _int_env(WORLD_SIZE, 1)
    if world < 1:
        raise ValueError(f"{WORLD_SIZE}: expected >= 1, got {world}")
    if world == 1:
        return LocalCommunicator()
    rank = _int_env(RANK, -1)
    if not 0 <= rank < world:
        raise ValueError(f"{RANK}: expected 0 <= rank < {world}, got {os.environ.get(RANK)!r}")
    directory = os.environ.get(RENDEZVOUS)
    if not directory or not os.path.isdir(directory):
        raise ValueError(f"{RENDEZVOUS}: expected an existing directory shared by all ranks, got {directory!r}")
    for key, value in NO_MULTICAST.items():  # also when started by another launcher
        os.environ[key] = value
    timeout = float(os.environ.get("FP4KIT_DIST_TIMEOUT", 300)) if timeout is None else timeout

    from . import nccl_lib

    nccl = nccl_lib.load()  # first: without NCCL (or CuPy) nothing else matters, and it says how to fix it
    import cupy

    cupy.cuda.Device(_int_env(DEVICE, _int_env(LOCAL_RANK, rank))).use()
    if rank == 0:
        unique_id = nccl.get_unique_id()
        publish_unique_id(directory, unique_id)
    else:
        unique_id = read_unique_id(directory, timeout=timeout)
    comm = NcclCommunicator(rank, world, unique_id)
    comm.barrier()
    return comm


def shutdown(comm: Communicator) -> None:
    """End a run on every rank: wait for this rank's device work, meet the other ranks at a
    barrier, then release the communicator. Called by all ranks after their last collective, it
    keeps NCCL's teardown from racing a rank that has already left (a process can otherwise hang
    at exit in the communicator's destruction)."""
    if comm.world_size > 1:
        comm.barrier()
    comm.close()
