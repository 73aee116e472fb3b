"""optim.state_dtype (run/moments.py): the int8 code and its round trip against bitsandbytes' own functions, a
200-step run near float32 AdamW, the moments' bytes and shardings, and an exact resume."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxtrain import data
from jaxtrain.core import config
from jaxtrain.analysis import memory
from jaxtrain.run import checkpoint, moments, step
from tests.helpers import mesh_of, trajectory


@functools.cache
def _bnb():
  pytest.importorskip("torch")
  return pytest.importorskip("bitsandbytes.functional")


@pytest.mark.parametrize("signed", [True, False])
def test_the_dynamic_code_is_bitsandbytes(signed):
  """Our code points, built from the dynamic tree code's definition, are bitsandbytes' 8-bit optimizers' map."""
  ref = _bnb().create_dynamic_map(signed=signed).numpy()
  np.testing.assert_allclose(moments.dynamic_code(signed), ref, rtol=2e-6, atol=0)


@pytest.mark.parametrize("signed, shape", [(True, (1000,)), (False, (1000,)), (True, (6, 512)), (False, (3, 768))])
def test_round_trip_equals_bitsandbytes_blockwise(signed, shape):
  """quantize -> dequantize equals bitsandbytes' quantize_blockwise -> dequantize_blockwise with its dynamic map and
  blocks of 256 (a partial last block for 1000 values; rows of whole blocks are its flat blocks), moments spanning
  six decades (Adam's second moment: squares of gradients)."""
  import torch
  bnb = _bnb()
  rng = np.random.default_rng(0)
  x = rng.standard_normal(shape).astype(np.float32) * 10.0 ** rng.uniform(-3, 0, shape).astype(np.float32)
  x = x if signed else x * x
  q = moments.quantize(jnp.asarray(x), signed)
  got = np.asarray(moments.dequantize(q, signed))
  codes, state = bnb.quantize_blockwise(torch.from_numpy(x.ravel()), code=bnb.create_dynamic_map(signed=signed),
                                        blocksize=moments.BLOCK)
  ref = bnb.dequantize_blockwise(codes, state).numpy().reshape(shape)
  np.testing.assert_allclose(np.asarray(q.scales).ravel(), state.absmax.numpy(), rtol=0, atol=0)
  same = np.asarray(q.codes).ravel() == codes.numpy()
  assert same.mean() > 0.5, f"{(~same).sum()} codes differ"
  np.testing.assert_allclose(got.ravel()[same], ref.ravel()[same], rtol=1e-6, atol=0)
  # bitsandbytes' CPU search does not always land on the nearest point (its unsigned search stops short of the
  # smallest ones): ours is the nearest (brute force here), so where the codes differ ours is the closer value
  scale = np.repeat(state.absmax.numpy(), moments.BLOCK)[:x.size]
  nearest = np.argmin(np.abs(x.ravel()[:, None] / scale[:, None] - moments.dynamic_code(signed)[None]), axis=1)
  np.testing.assert_array_equal(np.asarray(q.codes).ravel(), nearest)
  err, ref_err = np.abs(got - x).ravel(), np.abs(ref - x).ravel()
  assert np.all(err[~same] < ref_err[~same])


def _moment_bytes(setup, state_dtype: str) -> int:
  """One moment's bytes on one device, from the parameter shapes: int8 codes and a float32 scale per 256 values
  (float32 under 4096 values), or 4 or 2 bytes a value."""
  want = 0
  for x in jax.tree.leaves(setup.layout.abstract_params):
    if state_dtype == "int8" and x.size >= 4096:
      want += x.size + 4 * (x.size // x.shape[-1]) * -(-x.shape[-1] // 256)
    else:
      want += x.size * {"float32": 4, "bfloat16": 2, "int8": 4}[state_dtype]
  return want


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16", "int8"])
def test_the_bill_counts_the_moments_at_their_bytes(state_dtype):
  """Adam's m and v at 4+4, 2+2 or (int8) 1+1 bytes per value and 4 bytes per 256-value block per moment, float32
  below 4096 values, counted from the parameter shapes here; the bill's lines say how they are kept."""
  cfg = config.load("tiny", [f"optim.state_dtype={state_dtype}"])
  setup = step.Setup(cfg, mesh_of("dp=1"))
  want = _moment_bytes(setup, state_dtype)
  bill = memory.bill(setup, memory.grouped(memory.param_rows(setup)), margin=0.1)
  assert bill.items["adam_m"] == bill.items["adam_v"] == want
  n = setup.n_params
  assert want / n == pytest.approx({"float32": 4, "bfloat16": 2, "int8": 1.06}[state_dtype], abs=0.01)  # tiny
  assert bill.notes["adam_m"].startswith({"float32": "float32,", "bfloat16": "bfloat16 (optim.state_dtype)",
                                          "int8": "int8 codes"}[state_dtype])


def test_offload_moves_the_moments_at_their_stored_bytes():
  """optim.offload=host with int8 moments: per step the float32 master 3 times and both moments twice to the device,
  master and moments once back (offload.py's design), the moments at their stored bytes."""
  cfg = config.load("tiny", ["optim.state_dtype=int8", "optim.offload=host", "model.n_layers=1"])
  setup = step.Setup(cfg, mesh_of("dp=1"))
  n, w = setup.n_params, _moment_bytes(setup, "int8")
  assert setup.layout.link == (3 * 4 * n + 2 * 2 * w, 4 * n + 2 * w)


@pytest.mark.parametrize("allowed", [set(), {"model", "train", "tokenizer", "data"}])
def test_switching_state_dtype_on_resume_is_refused_in_one_line(allowed, tmp_path):
  """The saved moments are another dtype's arrays: refused even where --allow-mismatch lets math keys go, in one
  line naming both values; a checkpoint from before the key is float32's."""
  from jaxtrain.core.errors import UserError
  from jaxtrain.run import loop
  f32, i8 = (checkpoint.fingerprint(config.load("tiny", sets), "tok", "data")
             for sets in ([], ["optim.state_dtype=int8"]))
  for saved, current, words in ((f32, i8, "optim.state_dtype='float32', this run has optim.state_dtype='int8'"),
                                (i8, f32, "optim.state_dtype='int8', this run has optim.state_dtype='float32'")):
    with pytest.raises(UserError) as e:
      loop._same_run(current, allowed, None)(tmp_path, {"fingerprint": saved})  # noqa: SLF001
    assert "\n" not in str(e.value) and words in str(e.value), str(e.value)
  old = {**i8, "train": {k: v for k, v in i8["train"].items() if k != "optim.state_dtype"}}
  with pytest.raises(UserError, match="optim.state_dtype='float32', this run has optim.state_dtype='int8'"):
    loop._same_run(i8, allowed, None)(tmp_path, {"fingerprint": old})  # noqa: SLF001


SMALL = ["model.dtype=float32", "train.batch_size=8", "train.seq_len=32", "model.d_model=64", "model.n_heads=4",
         "model.n_kv_heads=2", "model.d_ff=128", "train.steps=200", "optim.warmup_steps=10"]


@functools.cache
def _losses(state_dtype: str, steps: int = 200):
  return trajectory(config.load("tiny", SMALL + [f"optim.state_dtype={state_dtype}"]), "dp=1", steps)[:, 0]


@pytest.mark.slow
@pytest.mark.parametrize("state_dtype, tol", [("bfloat16", 0.03), ("int8", 0.08)])
def test_200_steps_stay_near_float32_adamw(state_dtype, tol):
  """The same 200 steps as float32 AdamW: the loss within `tol` (relative) at every step (measured: 1.6% bfloat16,
  5.5% int8 at worst, a mid-run step), the mean of the last 20 within 1% (measured: 0.4%), and it trains."""
  ref, got = _losses("float32"), _losses(state_dtype)
  assert got[-1] < 0.4 * got[0]
  assert not np.array_equal(got, ref)  # the moments are rounded: the run is not float32's
  np.testing.assert_allclose(got, ref, rtol=tol)
  np.testing.assert_allclose(got[-20:].mean(), ref[-20:].mean(), rtol=0.01)


def _steps(setup, cfg, state, batches, n):
  out = []
  for _ in range(n):
    state, m = setup.step(state, setup.device_batch(next(batches)))
    out.append(float(m["loss"]))
  return state, out


@pytest.mark.slow
def test_int8_states_shard_like_the_master_and_resume_exactly(tmp_path):
  """fsdp=2: the codes sharded as the master; 3 steps, a checkpoint (orbax, as the trainer saves), a restore onto
  the abstract state, 3 more: bit for bit the 6 uninterrupted steps (losses, params and moments)."""
  cfg = config.load("tiny", SMALL[:-2] + ["optim.state_dtype=int8", "model.n_layers=1"])
  setup = step.Setup(cfg, mesh_of("fsdp=2"))
  mu = setup.state_shardings["opt"][0].mu
  quantized = [(k, q) for k, q in mu.items() if isinstance(q, moments.Quantized)]
  assert quantized and all(q.codes == setup.state_shardings["params"][k] for k, q in quantized)
  batches = data.batches(cfg)
  straight, ref = _steps(setup, cfg, setup.init(), batches, 6)
  batches.close()
  batches = data.batches(cfg)
  first, got = _steps(setup, cfg, setup.init(), batches, 3)
  ck = checkpoint.Checkpoints(tmp_path / "ck", 3, 0, False)
  ck.save(3, first, {})
  ck.wait()
  restored, _ = ck.restore(tmp_path / "ck" / "3", setup.abstract_state())
  ck.mgr.close()
  leaves = jax.tree.leaves(restored["opt"])
  assert any(x.dtype == jnp.uint8 for x in leaves)  # the checkpoint holds the codes as they are
  resumed, more = _steps(setup, cfg, restored, batches, 3)
  batches.close()
  assert got + more == ref
  for a, b in zip(jax.tree.leaves(jax.device_get(resumed)), jax.tree.leaves(jax.device_get(straight)), strict=True):
    np.testing.assert_array_equal(a, b)


def test_a_second_moment_rounded_to_zero_moves_a_parameter_no_further_than_float32_adam_can():
  """Values whose gradient stopped (a token absent since): their tiny v rounds to 0 in its block while m does not;
  the next update with g = 0 would be m / eps (about 1e3 here) without the clip to Adam's own bound."""
  from jaxtrain.run import optimizer as optim_lib
  b1, b2, eps = 0.9, 0.95, 1e-8
  opt = moments.scale_by_adam(b1, b2, eps, "int8")
  g = np.zeros((16, 512), np.float32)
  g[:, 0] = 1.0  # each block's absmax: the others' v = (1-b2) 1e-8 is below the code's smallest point (1e-7 of it)
  g[:, 1:] = 1e-4
  state = opt.init(jnp.zeros_like(g))
  _, state = opt.update(jnp.asarray(g), state)
  u, _ = opt.update(jnp.zeros_like(g), state)
  bound = float(optim_lib.adam_ratio_bound(config.OptimConfig(b1=b1, b2=b2, eps=eps), 2))
  assert float(jnp.max(jnp.abs(u))) <= bound * (1 + 1e-6)
  exact = optax.scale_by_adam(b1, b2, eps)  # the float32 reference: every update is inside the bound
  s = exact.init(jnp.zeros_like(g))
  _, s = exact.update(jnp.asarray(g), s)
  ref, _ = exact.update(jnp.zeros_like(g), s)
  assert float(jnp.max(jnp.abs(ref))) <= bound
