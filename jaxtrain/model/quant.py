"""Weight-only quantization of a frozen base weight (QLoRA's base, issue 41): `quantize` stores a weight as codes
and float32 scales, `dequantize` gives it back (jit-able; both are plain jnp), `nbytes` is the stored size for the
memory bill.

Formats (`fmt`):
- "nf4": 4-bit NormalFloat of QLoRA (Dettmers et al. 2023) with bitsandbytes' block rule: blocks of 64 consecutive
  values, one float32 absmax per block, each value times 1/absmax mapped to the nearest of the 16 NF4 levels (a
  value exactly between two levels takes the lower), two codes per uint8, the first value in the high nibble.
  Double quantization (8-bit scales) is not done: the scales stay float32.
- "int8": per-output-channel symmetric absmax: scale = absmax / 127 over the input axis, codes = round(w * (1 /
  scale)) (half to even) as int8 in [-127, 127]: times the float32 reciprocal, as nf4, because XLA may turn a
  division by a broadcast scale into that product in one program and not in another (a code 1 apart at a tie).

Layout. A weight has an input axis `in_axis` (the contracted one: 0 for an (in, out) projection, 1 for (E, in, out)
experts) and output axes, the rest. nf4 moves the input axis last: the blocks run along it, so codes are
(*out, in/2) and scales (*out, in/64); for an (in, out) weight that is the (out, in) order of a torch nn.Linear, so
the bytes are those bitsandbytes makes of the torch weight (a QLoRA checkpoint's). A weight sharded on an output
axis shards codes and scales the same way, and one sharded on its input axis into pieces of a multiple of 64 values
too: no block straddles two shards, so each shard dequantizes alone (`code_axes` maps a weight's sharding to the
codes'). An input axis that is not a multiple of 64 keeps bitsandbytes' flat rule instead (blocks over the
flattened (*out, in) array, codes (ceil(n/2),), scales (ceil(n/64),)): exact, but not shardable. int8 keeps the
weight's shape for the codes and drops the input axis for the scales.

Stacks. `lead` leading axes (a scanned stack's layers, MoE's experts) hold separate matrices, each quantized as
bitsandbytes quantizes one nn.Linear: the QTensor's `shape` and `in_axis` are one matrix's, its codes and scales
carry the leading axes in front. So a scan over a stack slices a QTensor into one layer's, which dequantizes
alone."""

from __future__ import annotations

import dataclasses
import math
import statistics

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 64  # nf4 values per absmax scale
FORMATS = ("nf4", "int8")


def nf4_levels() -> np.ndarray:
  """The 16 NF4 levels derived as the paper does: quantiles of N(0, 1) at evenly spaced probabilities from
  1 - delta down to 1/2, 8 on the positive side and 7 on the negative (9 and 8 points with the 1/2 dropped, so 0 is
  exact and shared), normalised to [-1, 1]. delta is the mean of 1/(2*15) and 1/(2*16), the paper's choice that
  keeps the end quantiles finite for both halves. Within 6 float32 ulps (< 4e-7) of the published table `NF4`,
  whose last bits come from the authors' own quantile arithmetic; the codes need the published bits."""
  offset = 1 - (1 / 30 + 1 / 32) / 2
  ppf = statistics.NormalDist().inv_cdf
  pos = [ppf(p) for p in np.linspace(offset, 0.5, 9)[:-1]]
  neg = [-ppf(p) for p in np.linspace(offset, 0.5, 8)[:-1]]
  levels = np.sort(np.array(pos + neg + [0.0]))
  return (levels / np.abs(levels).max()).astype(np.float32)


# The published NF4 levels (QLoRA paper, appendix E; bitsandbytes' table), float32, sorted: code i is NF4[i].
NF4 = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
    0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], np.float32)
# decision points between consecutive levels, in float32 as the level table is
NF4_MIDS = ((NF4[:-1] + NF4[1:]) / np.float32(2)).astype(np.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QTensor:
  """A quantized weight: arrays `codes`, `scales` (pytree leaves); static `shape`, `fmt`, `in_axis`."""
  codes: jax.Array  # nf4: uint8, 2 codes each; int8: int8, the weight's shape
  scales: jax.Array  # float32: nf4 one per block, int8 one per output channel
  shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  fmt: str = dataclasses.field(metadata=dict(static=True))
  in_axis: int = dataclasses.field(default=0, metadata=dict(static=True))

  @property
  def lead(self) -> int:
    """Leading axes of the codes in front of one matrix's: a stack's (see the module's Stacks)."""
    return self.codes.ndim - len(stored_shapes(self.shape, self.fmt, self.in_axis)[0])


def _blocked(shape, in_axis) -> bool:
  """Whether nf4 keeps the (*out, in/2) layout (the input axis is whole blocks) rather than the flat one."""
  return shape[in_axis] % BLOCK == 0


def _check(shape, fmt, in_axis):
  if fmt not in FORMATS:
    raise ValueError(f"unknown quantization format {fmt!r}; known: {FORMATS}")
  if not -len(shape) <= in_axis < len(shape):
    raise ValueError(f"in_axis {in_axis} out of range for a weight of shape {tuple(shape)}")
  return in_axis % len(shape)


def quantize(w, fmt: str, in_axis: int = 0, lead: int = 0) -> QTensor:
  """`w` as a QTensor in `fmt` (jit-able with fmt, in_axis and lead static); `in_axis` counts `w`'s axes, the
  first `lead` of which hold separate matrices."""
  if lead:
    return jax.vmap(lambda m: quantize(m, fmt, in_axis - 1, lead - 1))(w)
  shape = tuple(int(s) for s in w.shape)
  in_axis = _check(shape, fmt, in_axis)
  w = jnp.asarray(w, jnp.float32)
  if fmt == "int8":
    absmax = jnp.max(jnp.abs(w), axis=in_axis)
    scales = absmax * np.float32(1 / 127)  # what XLA makes of absmax / 127 anyway: one float32 product
    inv = jnp.expand_dims(1 / jnp.where(scales > 0, scales, 1), in_axis)  # an all-zero channel: codes 0
    codes = jnp.clip(jnp.round(w * inv), -127, 127).astype(jnp.int8)  # the clip: absmax/scale may round past 127
    return QTensor(codes, scales, shape, fmt, in_axis)
  return _nf4(w, shape, in_axis)


def _blocks(w_OxI, blocked: bool):
  """The nf4 blocks of a weight with its input axis last: (*out, in/64, 64), or flat (ceil(n/64), 64) padded with
  zeros (they leave a partial block's absmax alone and take level 0, as bitsandbytes' padding does)."""
  if blocked:
    return w_OxI.reshape(*w_OxI.shape[:-1], -1, BLOCK)
  n = w_OxI.size
  return jnp.pad(w_OxI.reshape(-1), (0, -n % BLOCK)).reshape(-1, BLOCK)


def _nf4(w, shape, in_axis) -> QTensor:
  w_OxI = jnp.moveaxis(w, in_axis, -1)
  blocked, n = _blocked(shape, in_axis), math.prod(shape)
  w_Bx64 = _blocks(w_OxI, blocked)
  absmax_B = jnp.max(jnp.abs(w_Bx64), axis=-1)
  # times the reciprocal, as bitsandbytes does (the codes must be its codes, bit for bit)
  inv_B = jnp.where(absmax_B > 0, 1 / jnp.where(absmax_B > 0, absmax_B, 1), 0)
  x_Bx64 = w_Bx64 * inv_B[..., None]
  # the nearest level: how many decision points lie strictly below (a 4-step binary search, no 15x temporary)
  idx_Bx64 = jnp.searchsorted(jnp.asarray(NF4_MIDS), x_Bx64, side="left", method="scan_unrolled").astype(jnp.uint8)
  pairs = idx_Bx64.reshape(*idx_Bx64.shape[:-1], BLOCK // 2, 2)
  codes = (pairs[..., 0] << 4) | pairs[..., 1]  # (..., 32): first value high
  if blocked:
    codes = codes.reshape(*w_OxI.shape[:-1], shape[in_axis] // 2)
  else:
    codes = codes.reshape(-1)[:-(-n // 2)]
  return QTensor(codes, absmax_B, shape, "nf4", in_axis)


def dequantize(q: QTensor, dtype=jnp.bfloat16) -> jax.Array:
  """The weight `q` stands for, in `dtype` (computed in float32, then cast); a stack's (`lead`) whole."""
  if q.lead:  # a stack: each matrix alone
    return jax.vmap(lambda c, s: dequantize(QTensor(c, s, q.shape, q.fmt, q.in_axis), dtype))(q.codes, q.scales)
  if q.fmt == "int8":
    return (q.codes.astype(jnp.float32) * jnp.expand_dims(q.scales, q.in_axis)).astype(dtype)
  if q.fmt != "nf4":
    raise ValueError(f"unknown quantization format {q.fmt!r}; known: {FORMATS}")
  out_shape = tuple(s for a, s in enumerate(q.shape) if a != q.in_axis)
  n_in, n = q.shape[q.in_axis], math.prod(q.shape)
  codes = q.codes
  if not _blocked(q.shape, q.in_axis):  # flat: whole blocks again, then cut to the weight
    codes = jnp.pad(codes, (0, q.scales.size * BLOCK // 2 - codes.size))
  # only the last axis splits, so a sharded weight's codes dequantize in place
  idx = jnp.stack([codes >> 4, codes & 0xF], axis=-1).reshape(*q.scales.shape, BLOCK)
  w_Bx64 = jnp.asarray(NF4)[idx] * q.scales[..., None]
  if _blocked(q.shape, q.in_axis):
    w_OxI = w_Bx64.reshape(*out_shape, n_in)
  else:
    w_OxI = w_Bx64.reshape(-1)[:n].reshape(*out_shape, n_in)
  return jnp.moveaxis(w_OxI, -1, q.in_axis).astype(dtype)


def is_quantized(x) -> bool:
  return isinstance(x, QTensor)


def dequantized(tree, dtype):
  """`tree` with every QTensor dequantized to `dtype`; the rest as it is."""
  return jax.tree.map(lambda x: dequantize(x, dtype) if is_quantized(x) else x, tree, is_leaf=is_quantized)


def stored_shapes(shape, fmt: str, in_axis: int = 0, lead: int = 0) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(codes shape, scales shape) of a weight of `shape` in `fmt` (`lead`: as `quantize`)."""
  shape = tuple(shape)
  if lead:
    codes, scales = stored_shapes(shape[lead:], fmt, in_axis - lead)
    return (*shape[:lead], *codes), (*shape[:lead], *scales)
  in_axis = _check(shape, fmt, in_axis)
  out_shape = tuple(s for a, s in enumerate(shape) if a != in_axis)
  if fmt == "int8":
    return shape, out_shape
  if _blocked(shape, in_axis):
    return (*out_shape, shape[in_axis] // 2), (*out_shape, shape[in_axis] // BLOCK)
  n = math.prod(shape)
  return (-(-n // 2),), (-(-n // BLOCK),)


def nbytes(shape, fmt: str, in_axis: int = 0, lead: int = 0) -> int:
  """Bytes stored for a weight of `shape` in `fmt`: codes (1 byte per int8, half a byte per nf4 code) plus float32
  scales."""
  codes, scales = stored_shapes(shape, fmt, in_axis, lead)
  return math.prod(codes) + 4 * math.prod(scales)


def code_axes(shape, fmt: str, spec, in_axis: int = 0, lead: int = 0) -> tuple[tuple, tuple]:
  """(codes spec, scales spec): the per-axis sharding of the stored arrays of a weight whose axes are sharded as
  `spec` (one entry per weight axis: a mesh or logical axis name, or None). A shard of the input axis must hold a
  multiple of 64 values for nf4; the flat nf4 layout is replicated (a stack's leading axes keep their split)."""
  shape, spec = tuple(shape), tuple(spec)
  if lead:
    codes, scales = code_axes(shape[lead:], fmt, spec[lead:], in_axis - lead)
    return (*spec[:lead], *codes), (*spec[:lead], *scales)
  in_axis = _check(shape, fmt, in_axis)
  if len(spec) != len(shape):
    raise ValueError(f"spec {spec} has {len(spec)} entries for a weight of {len(shape)} axes")
  out_spec = tuple(s for a, s in enumerate(spec) if a != in_axis)
  if fmt == "int8":
    return spec, out_spec
  if not _blocked(shape, in_axis):
    return (None,), (None,)
  return (*out_spec, spec[in_axis]), (*out_spec, spec[in_axis])


def split_axes(shape, fmt: str, spec, ways, in_axis: int = 0, lead: int = 0) -> tuple[tuple, tuple, bool]:
  """(codes spec, scales spec, whether the input axis was kept whole) of a weight of `shape` whose axes are split as
  `spec` (mesh axis entries; `ways(entry)`: how many devices one splits over): `code_axes`, with an nf4 input axis
  whose shards would not be whole blocks of 64 kept whole (a block would straddle two shards)."""
  spec = (*spec, *(None,) * (len(shape) - len(spec)))
  whole = fmt == "nf4" and (shape[in_axis] // ways(spec[in_axis])) % BLOCK != 0 and spec[in_axis] is not None
  if whole:
    spec = tuple(None if a == in_axis else s for a, s in enumerate(spec))
  return (*code_axes(shape, fmt, spec, in_axis, lead), whole)
