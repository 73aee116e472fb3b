"""Weight quantization (jaxtrain.model.quant) against references written here from the formats' definitions: NF4
against the published table and a plain numpy block quantizer, and against bitsandbytes itself (its CPU path, bit
for bit); int8 against a numpy per-channel quantizer. Then the error bounds, the stored bytes, jit, and the layout
that lets each shard of a sharded weight dequantize alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxtrain.model import quant

# QLoRA paper (Dettmers et al. 2023), appendix E: the NF4 data type's 16 values.
PUBLISHED_NF4 = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
    0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], np.float32)

# (weight shape, input axis): a projection, experts with the input axis in the middle, and shapes whose input
# axis is not whole blocks (the flat layout; an odd count of values).
SHAPES = [((256, 96), 0), ((96, 128), 1), ((4, 128, 32), 1), ((33, 7), 0), ((65, 3), 0)]


def _weight(shape, seed=0):
  """Normal values with a few blocks' worth of outliers and one all-zero output channel."""
  rng = np.random.default_rng(seed)
  w = rng.standard_normal(shape).astype(np.float32) * 0.02
  w.reshape(-1)[rng.integers(0, w.size, 5)] *= 50
  w[..., 0] = 0
  return w


def _ref_nf4(w, in_axis):
  """A plain numpy NF4 quantizer: flatten with the input axis last, blocks of 64 (the last one partial), absmax
  per block, the nearest level by distance (argmin: the lower level on a tie), two codes a byte, high first."""
  flat = np.moveaxis(w, in_axis, -1).reshape(-1).astype(np.float32)
  codes, scales = [], []
  for start in range(0, flat.size, 64):
    block = flat[start:start + 64]
    absmax = np.abs(block).max()
    x = block * (np.float32(1) / absmax) if absmax > 0 else np.zeros_like(block)
    codes.append(np.argmin(np.abs(x[:, None].astype(np.float64) - PUBLISHED_NF4[None, :]), axis=1))
    scales.append(absmax)
  idx = np.concatenate(codes).astype(np.uint8)
  idx = np.append(idx, np.uint8(7)) if idx.size % 2 else idx
  return (idx[0::2] << 4) | idx[1::2], np.array(scales, np.float32)


def test_nf4_levels_are_the_published_table():
  """The table has the paper's shape (7 negative levels, an exact 0, 8 positive, ends at -1 and 1), the quantile
  derivation lands on the published values, and the module quantizes with exactly those."""
  derived = quant.nf4_levels()
  assert (derived < 0).sum() == 7 and (derived > 0).sum() == 8 and 0.0 in derived
  assert derived[0] == -1 and derived[-1] == 1 and np.all(np.diff(derived) > 0)
  np.testing.assert_allclose(derived, PUBLISHED_NF4, rtol=0, atol=4e-7)
  np.testing.assert_array_equal(quant.NF4, PUBLISHED_NF4)


@pytest.mark.parametrize("shape,in_axis", SHAPES)
def test_nf4_matches_a_numpy_block_quantizer(shape, in_axis):
  w = _weight(shape)
  q = quant.quantize(w, "nf4", in_axis)
  codes, scales = _ref_nf4(w, in_axis)
  assert q.codes.dtype == jnp.uint8 and q.scales.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(q.codes).reshape(-1), codes)
  np.testing.assert_array_equal(np.asarray(q.scales).reshape(-1), scales)
  levels = PUBLISHED_NF4[np.stack([codes >> 4, codes & 15], -1).reshape(-1)][:w.size]
  want = (levels.reshape(-1) * np.repeat(scales, 64)[:w.size]).reshape(np.moveaxis(w, in_axis, -1).shape)
  np.testing.assert_array_equal(np.asarray(quant.dequantize(q, jnp.float32)), np.moveaxis(want, -1, in_axis))


def test_nf4_ties_take_the_lower_level():
  """Values exactly between two levels (a block with absmax 1) go down, as bitsandbytes' decision tree does."""
  mids = ((PUBLISHED_NF4[:-1] + PUBLISHED_NF4[1:]) / np.float32(2)).astype(np.float32)
  block = np.zeros(64, np.float32)
  block[0], block[1:16] = 1.0, mids
  codes = np.asarray(quant.quantize(block, "nf4").codes)
  idx = np.stack([codes >> 4, codes & 15], -1)
  np.testing.assert_array_equal(idx.reshape(-1)[1:16], np.arange(15))


@pytest.mark.parametrize("shape,in_axis", SHAPES)
def test_nf4_is_bitsandbytes_bit_for_bit(shape, in_axis):
  """bitsandbytes quantizes the torch layout (out, in), flattened: the same codes and scales, the same weight
  back (dequantization is one float32 product either way)."""
  torch = pytest.importorskip("torch")
  bnbf = pytest.importorskip("bitsandbytes.functional")
  w = _weight(shape, seed=1)
  w_OxI = torch.from_numpy(np.ascontiguousarray(np.moveaxis(w, in_axis, -1)))
  codes, state = bnbf.quantize_4bit(w_OxI, quant_type="nf4", blocksize=64)
  np.testing.assert_array_equal(state.code.numpy(), PUBLISHED_NF4)
  q = quant.quantize(w, "nf4", in_axis)
  np.testing.assert_array_equal(np.asarray(q.codes).reshape(-1), codes.numpy().reshape(-1))
  np.testing.assert_array_equal(np.asarray(q.scales).reshape(-1), state.absmax.numpy())
  back = bnbf.dequantize_4bit(codes, state).numpy()
  got = np.moveaxis(np.asarray(quant.dequantize(q, jnp.float32)), in_axis, -1)
  np.testing.assert_allclose(got, back, rtol=1e-6, atol=0)


def test_nf4_error_is_at_most_half_a_level_gap():
  w = _weight((512, 64))
  q = quant.quantize(w, "nf4")
  absmax = np.abs(w.T.reshape(64, 8, 64)).max(-1)  # (out, in/64): each block's scale
  bound = np.repeat(absmax, 64, axis=1).T * np.diff(PUBLISHED_NF4).max() / 2
  err = np.abs(w - np.asarray(quant.dequantize(q, jnp.float32)))
  assert np.all(err <= bound * (1 + 1e-6))


def _ref_int8(w, in_axis):
  scale = np.abs(w).max(axis=in_axis) * np.float32(1 / 127)  # the float32 product (XLA's form of absmax / 127)
  inv = np.float32(1) / np.where(scale > 0, scale, np.float32(1))  # times the float32 reciprocal
  return np.clip(np.round(w * np.expand_dims(inv, in_axis)), -127, 127).astype(np.int8), scale


@pytest.mark.parametrize("shape,in_axis", SHAPES)
def test_int8_matches_a_numpy_per_channel_quantizer(shape, in_axis):
  w = _weight(shape, seed=2)
  q = quant.quantize(w, "int8", in_axis)
  codes, scale = _ref_int8(w, in_axis)
  assert q.codes.dtype == jnp.int8 and q.scales.shape == tuple(np.delete(shape, in_axis))
  np.testing.assert_array_equal(np.asarray(q.codes), codes)
  np.testing.assert_array_equal(np.asarray(q.scales), scale)
  top = np.abs(np.asarray(q.codes)).max(axis=in_axis)
  np.testing.assert_array_equal(top, np.where(scale > 0, 127, 0))  # each channel's absmax is +-127, a zero one 0
  deq = np.asarray(quant.dequantize(q, jnp.float32))
  half = np.expand_dims(scale, in_axis) / 2
  assert np.all(np.abs(w - deq) <= half * (1 + 1e-5))


@pytest.mark.parametrize("fmt", quant.FORMATS)
@pytest.mark.parametrize("shape,in_axis", SHAPES + [((4096, 1024), 0)])
def test_nbytes_is_what_is_stored(fmt, shape, in_axis):
  q = quant.quantize(jnp.ones(shape, jnp.float32), fmt, in_axis)
  assert quant.nbytes(shape, fmt, in_axis) == q.codes.nbytes + q.scales.nbytes
  assert quant.stored_shapes(shape, fmt, in_axis) == (q.codes.shape, q.scales.shape)


def test_nbytes_by_hand():
  n = 4096 * 1024
  assert quant.nbytes((4096, 1024), "nf4") == n // 2 + 4 * n // 64  # 4.5 bits a value
  assert quant.nbytes((4096, 1024), "int8") == n + 4 * 1024
  assert quant.nbytes((33, 7), "nf4") == 116 + 4 * 4  # 231 values: 116 bytes, 4 blocks (the last partial)


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_jit_and_pytree(fmt):
  w = _weight((128, 64))
  q = jax.jit(quant.quantize, static_argnums=(1, 2))(w, fmt, 0)
  eager = quant.quantize(w, fmt)
  assert len(jax.tree.leaves(q)) == 2
  np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(eager.codes))
  deq = jax.jit(quant.dequantize, static_argnums=1)(q, jnp.bfloat16)
  assert deq.dtype == jnp.bfloat16 and deq.shape == w.shape
  np.testing.assert_array_equal(np.asarray(deq), np.asarray(quant.dequantize(eager, jnp.bfloat16)))


@pytest.mark.parametrize("fmt,shape,in_axis", [("nf4", (256, 96), 0), ("int8", (256, 96), 0),
                                               ("nf4", (4, 256, 32), 1)])
def test_each_shard_dequantizes_alone(fmt, shape, in_axis):
  """A weight sharded 2 ways on its input axis and 4 on an output axis: each device dequantizes its own codes
  and scales (laid out by code_axes) into its own piece of the weight."""
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("i", "o"))
  spec = [None] * len(shape)
  spec[in_axis], spec[-1] = "i", "o"
  w = _weight(shape, seed=3)
  q = quant.quantize(w, fmt, in_axis)
  codes_spec, scales_spec = quant.code_axes(shape, fmt, spec, in_axis)
  local = list(shape)
  local[in_axis], local[-1] = shape[in_axis] // 2, shape[-1] // 4

  def piece(codes, scales):
    return quant.dequantize(quant.QTensor(codes, scales, tuple(local), fmt, in_axis), jnp.float32)

  shards = jax.jit(jax.shard_map(piece, mesh=mesh, in_specs=(P(*codes_spec), P(*scales_spec)),
                                 out_specs=P(*spec)))
  codes = jax.device_put(q.codes, NamedSharding(mesh, P(*codes_spec)))
  scales = jax.device_put(q.scales, NamedSharding(mesh, P(*scales_spec)))
  np.testing.assert_array_equal(np.asarray(shards(codes, scales)), np.asarray(quant.dequantize(q, jnp.float32)))


def test_code_axes():
  assert quant.code_axes((256, 96), "nf4", ("embed", "mlp")) == (("mlp", "embed"), ("mlp", "embed"))
  assert quant.code_axes((8, 256, 96), "nf4", ("exp", "embed", "mlp"), 1) == (("exp", "mlp", "embed"),) * 2
  assert quant.code_axes((256, 96), "int8", ("embed", "mlp")) == (("embed", "mlp"), ("mlp",))
  assert quant.code_axes((33, 7), "nf4", ("embed", "mlp")) == ((None,), (None,))


def test_bad_format():
  with pytest.raises(ValueError, match="unknown quantization format"):
    quant.quantize(jnp.ones((64, 2)), "fp8")
