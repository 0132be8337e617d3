"""Tensor-parallel NVFP4 linear layers: each rank holds a slice of ``W [N, K]`` in a local
`fp4kit.layers.Linear` (its GEMM, buffers and graph capture unchanged) plus one collective.

* `ColumnParallelLinear`: rank ``r`` holds output rows ``[r N/world, (r+1) N/world)`` and computes
  them from the full input; ``gather_output=True`` all-gathers the full ``[..., N]`` (written in
  place into a gather buffer; one row-copy kernel restores ``[..., N]`` order when more than one
  row), ``False`` leaves it sharded (the input of a `RowParallelLinear`).
* `RowParallelLinear`: rank ``r`` holds input columns ``[r K/world, (r+1) K/world)`` and takes
  that slice of the input; the fp32 partial outputs are all-reduced (sum, rank order), then the
  bias is added and the result cast to bf16 once. W4A4 with a dynamic activation scale uses the
  group's scale by default (each rank's encode scale, an all-reduce ``min``, the quantization
  with it): the activation's codes are then the slices of the single-device layer's.

Construction: ``from_float`` quantizes each shard on its own (its own global scale, as a
sharded checkpoint would have); ``shard`` slices an existing `Linear` (every byte and the global
scale kept), which equals that layer up to the fp32 summation order of the row-parallel sum.
Neither reads anything back on the host: after one eager call a call can be captured in a CUDA
graph.
"""

from __future__ import annotations

import numpy as np

from ..formats import Nvfp4Tensor, to_linear
from ..layers.linear import MODES, Linear
from ..ops import quant as quant_ops
from ..runtime import arrays
from . import kernels
from .comm import Communicator, copy_bits

ACTIVATION_SCALES = ("group", "local")


def _check_comm(comm) -> None:
    if not isinstance(comm, Communicator):
        raise TypeError(f"comm: expected an fp4kit.distributed Communicator, got {type(comm).__name__}")


def _check_linear(name: str, linear) -> None:
    if not isinstance(linear, Linear):
        raise TypeError(f"{name}: expected an fp4kit.layers.Linear, got {type(linear).__name__}")
    if linear.weight.scale_layout == "swizzled":
        raise ValueError(f"{name}: expected a weight with linear or tiled block scales, got 'swizzled'")


def shard_slice(size: int, comm: Communicator, what: str, multiple: int = 1) -> slice:
    """This rank's part of ``size`` (ValueError naming ``what`` unless ``world * multiple`` divides it)."""
    world = comm.world_size
    if size % (world * multiple):
        extra = f" times {multiple}" if multiple > 1 else ""
        raise ValueError(f"{what}: {size} is not divisible by comm.world_size={world}{extra}")
    part = size // world
    return slice(comm.rank * part, (comm.rank + 1) * part)


def _copy_local(linear: Linear, weight: Nvfp4Tensor, *, row_decode=None, bias=None) -> Linear:
    local = Linear(weight, bias=bias, mode=linear.mode, input_scale=linear.input_scale, row_decode=row_decode)
    local.decode_max_m = linear.decode_max_m
    return local


class _Buffers:
    """Layer-owned buffers, one set per input shape (numpy: fresh per call)."""

    def __init__(self):
        self._by_key: dict = {}

    def get(self, key, like, make):
        if not arrays.is_device_array(like):
            return make(np)
        buf = self._by_key.get(key)
        if buf is None:
            import cupy

            buf = self._by_key[key] = make(cupy)
        return buf


class ColumnParallelLinear:
    """Output rows split over ranks (see the module docstring).

    Parameters
    ----------
    local : Linear ``[N / world, K]`` — this rank's rows (with their bias slice)
    comm : Communicator
    gather_output : bool — all-gather the full output (True) or return this rank's ``[..., N / world]``
    """

    def __init__(self, local: Linear, comm: Communicator, *, gather_output: bool = True):
        _check_linear("local", local)
        _check_comm(comm)
        self.local, self.comm, self.gather_output = local, comm, bool(gather_output)
        self._buffers = _Buffers()

    @property
    def out_features(self) -> int:
        return self.local.out_features * self.comm.world_size

    @property
    def in_features(self) -> int:
        return self.local.in_features

    @classmethod
    def from_float(cls, weight, comm: Communicator, *, bias=None, mode: str = "w4a4", input_scale=None,
                   gather_output: bool = True) -> "ColumnParallelLinear":
        """Quantize this rank's rows of the float ``weight [N, K]`` (their own global scale)."""
        _check_comm(comm)
        weight = arrays.as_array(weight, "weight")
        if weight.ndim != 2:
            raise ValueError(f"weight: expected [N, K], got {arrays.describe(weight)}")
        rows = shard_slice(weight.shape[0], comm, "weight: out_features N")
        if bias is not None:
            bias = arrays.as_array(bias, "bias")
            if tuple(bias.shape) != (weight.shape[0],):
                raise ValueError(f"bias: expected [{weight.shape[0]}], got {arrays.describe(bias)}")
            bias = bias[rows].copy()
        local = Linear.from_float(weight[rows].copy(), bias=bias, mode=mode, input_scale=input_scale)
        return cls(local, comm, gather_output=gather_output)

    @classmethod
    def shard(cls, linear: Linear, comm: Communicator, *, gather_output: bool = True) -> "ColumnParallelLinear":
        """This rank's rows of an existing layer (bytes and global scale kept)."""
        _check_linear("linear", linear)
        _check_comm(comm)
        w = to_linear(linear.weight)  # shards are cut in the checkpoint layout, then tiled by Linear
        rows = shard_slice(w.shape[0], comm, "linear: out_features N")
        part = Nvfp4Tensor(w.packed[rows].copy(), w.block_scales[rows].copy(), w.global_scale.copy(), "linear",
                           (rows.stop - rows.start, w.shape[1]))
        take = (lambda a: None if a is None else a[rows].copy())
        local = _copy_local(linear, part, row_decode=take(linear.row_decode), bias=take(linear.bias))
        return cls(local, comm, gather_output=gather_output)

    def __call__(self, x, *, out=None):
        """``x [..., K]`` (the full input, the same on every rank) to ``[..., N]`` (gathered) or
        ``[..., N / world]``. On the device the result is a layer-owned buffer (one per input
        shape) unless ``out`` is given."""
        x = arrays.as_array(x, "x")
        if not self.gather_output:
            return self.local(x, out=out)
        if x.ndim == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"x: expected [..., {self.in_features}], got shape {tuple(x.shape)}")
        lead = tuple(x.shape[:-1])
        m, n, world = int(np.prod(lead, dtype=np.int64)), self.local.out_features, self.comm.world_size
        if out is not None:
            arrays.check_out("out", out, (*lead, self.out_features), arrays.BF16, x)
        gathered = self._buffers.get(("gather", lead), x, lambda xp: xp.empty((world, m, n), arrays.BF16))
        if (m * n * 2) % 16 == 0:  # the GEMM writes straight into this rank's part (NCCL's in-place gather)
            mine = gathered[self.comm.rank]
        else:  # that part would not be 16-byte aligned for the GEMM's output
            mine = self._buffers.get(("mine", lead), x, lambda xp: xp.empty((m, n), arrays.BF16))
        self.local(x.reshape(m, -1), out=mine)
        self.comm.all_gather(mine, gathered)
        if world == 1 or m == 1:  # [world, m, n] is already [m, world * n]
            result = gathered.reshape(*lead, self.out_features)
            if out is not None:
                copy_bits(out, result)
                return out
            return result
        # row i of [m * world, n] is shard i % world of token i // world
        order = self._buffers.get(("order", m), x, lambda xp: xp.asarray(
            (np.arange(m * world) % world) * m + np.arange(m * world) // world, dtype=np.uint32))
        result = out if out is not None else self._buffers.get(
            ("out", lead), x, lambda xp: xp.empty((*lead, self.out_features), arrays.BF16))
        kernels.copy_rows(gathered.reshape(world * m, n), result.reshape(m * world, n), m * world, src_rows=order)
        return result


class RowParallelLinear:
    """Input columns split over ranks (see the module docstring).

    Parameters
    ----------
    local : Linear ``[N, K / world]`` without bias — this rank's columns
    comm : Communicator
    bias : fp32 or bf16 ``[N]``, optional — added once, after the all-reduce
    activation_scale : "group" (default) or "local" — W4A4 with a dynamic activation scale:
        the group's scale (one more all-reduce of one value; equal to the single-device layer)
        or each rank's own (no extra collective; a different, equally valid quantization)
    input_is_sharded : bool — ``x`` is this rank's ``[..., K / world]`` slice (True, e.g. the
        output of a `ColumnParallelLinear` with ``gather_output=False``) or the full ``[..., K]``
    """

    def __init__(self, local: Linear, comm: Communicator, *, bias=None, activation_scale: str = "group",
                 input_is_sharded: bool = True):
        _check_linear("local", local)
        _check_comm(comm)
        if local.bias is not None:
            raise ValueError("local: the local Linear must have no bias (pass bias= to RowParallelLinear: it is added "
                             "once, after the all-reduce)")
        if activation_scale not in ACTIVATION_SCALES:
            raise ValueError(f"activation_scale: expected one of {ACTIVATION_SCALES}, got {activation_scale!r}")
        if bias is not None:
            bias = arrays.as_array(bias, "bias")
            if tuple(bias.shape) != (local.out_features,) or bias.dtype not in (np.float32, arrays.BF16):
                raise ValueError(f"bias: expected float32 or bfloat16 [{local.out_features}], got {arrays.describe(bias)}")
            arrays.check_same_device(bias=bias, weight=local.weight.packed)
        self.local, self.comm, self.bias = local, comm, bias
        self.activation_scale, self.input_is_sharded = activation_scale, bool(input_is_sharded)
        self._buffers = _Buffers()

    @property
    def out_features(self) -> int:
        return self.local.out_features

    @property
    def in_features(self) -> int:
        return self.local.in_features * self.comm.world_size

    @property
    def mode(self) -> str:
        return self.local.mode

    @classmethod
    def from_float(cls, weight, comm: Communicator, *, bias=None, mode: str = "w4a4", input_scale=None,
                   activation_scale: str = "group", input_is_sharded: bool = True) -> "RowParallelLinear":
        """Quantize this rank's columns of the float ``weight [N, K]`` (their own global scale);
        ``K / world`` must be a multiple of 16 (an NVFP4 block never straddles two ranks)."""
        _check_comm(comm)
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        weight = arrays.as_array(weight, "weight")
        if weight.ndim != 2:
            raise ValueError(f"weight: expected [N, K], got {arrays.describe(weight)}")
        cols = shard_slice(weight.shape[1], comm, "weight: in_features K", multiple=16)
        local = Linear.from_float(weight[:, cols].copy(), mode=mode, input_scale=input_scale)
        return cls(local, comm, bias=bias, activation_scale=activation_scale, input_is_sharded=input_is_sharded)

    @classmethod
    def shard(cls, linear: Linear, comm: Communicator, *, activation_scale: str = "group",
              input_is_sharded: bool = True) -> "RowParallelLinear":
        """This rank's columns of an existing layer (bytes and global scale kept; its bias is
        added after the all-reduce)."""
        _check_linear("linear", linear)
        _check_comm(comm)
        w = to_linear(linear.weight)  # shards are cut in the checkpoint layout, then tiled by Linear
        cols = shard_slice(w.shape[1], comm, "linear: in_features K", multiple=16)
        k0, k1 = cols.start, cols.stop
        part = Nvfp4Tensor(w.packed[:, k0 // 2: k1 // 2].copy(), w.block_scales[:, k0 // 16: k1 // 16].copy(),
                           w.global_scale.copy(), "linear", (w.shape[0], k1 - k0))
        local = _copy_local(linear, part, row_decode=linear.row_decode)
        return cls(local, comm, bias=linear.bias, activation_scale=activation_scale, input_is_sharded=input_is_sharded)

    def __call__(self, x, *, out=None):
        """``x [..., K / world]`` (or ``[..., K]`` with ``input_is_sharded=False``) to ``[..., N]``
        bf16, the same on every rank. On the device the result is a layer-owned buffer (one per
        input shape) unless ``out`` is given."""
        x = arrays.as_array(x, "x")
        k_local = self.local.in_features
        expected = k_local if self.input_is_sharded else self.in_features
        if x.ndim == 0 or x.shape[-1] != expected:
            what = "this rank's slice" if self.input_is_sharded else "the full input"
            raise ValueError(f"x: expected [..., {expected}] ({what}), got shape {tuple(x.shape)}")
        lead = tuple(x.shape[:-1])
        if not self.input_is_sharded:
            sl = slice(self.comm.rank * k_local, (self.comm.rank + 1) * k_local)
            part = self._buffers.get(("slice", lead, x.dtype), x, lambda xp: xp.empty((*lead, k_local), x.dtype))
            copy_bits(part, x[..., sl])
            x = part
        partial = self._buffers.get(("partial", lead), x, lambda xp: xp.empty((*lead, self.out_features), np.float32))
        self.local.gemm(self._activation(x, lead), out=partial)
        self.comm.all_reduce(partial, "sum")
        if out is None:
            out = self._buffers.get(("out", lead), x, lambda xp: xp.empty((*lead, self.out_features), arrays.BF16))
        else:
            arrays.check_out("out", out, (*lead, self.out_features), arrays.BF16, x)
        kernels.bias_to_bf16(partial, self.bias, out)
        return out

    def _activation(self, x, lead):
        if self.mode == "w4a16":
            if x.dtype != arrays.BF16:
                raise TypeError(f"x: mode 'w4a16' takes bfloat16 input, got {x.dtype}")
            return x
        k = self.local.in_features

        def make(xp):
            scale = xp.zeros(1, np.float32)
            return Nvfp4Tensor(xp.empty((*lead, k // 2), np.uint8), xp.empty((*lead, k // 16), np.uint8),
                               scale.reshape(()), "linear", (*lead, k)), scale

        act, scale = self._buffers.get(("act", lead, x.dtype), x, make)
        static = self.local.input_scale
        if static is not None:
            return quant_ops.quantize(x, global_scale=static, out=act)
        quant_ops.quantize(x, out=act)
        if self.activation_scale == "group" and self.comm.world_size > 1:
            self.comm.all_reduce(scale, "min")  # the smallest S is the S of the largest amax
            quant_ops.quantize(x, global_scale=act.global_scale, out=act)
        return act
