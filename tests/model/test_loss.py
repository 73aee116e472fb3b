"""Chunked, vocabulary-parallel cross-entropy (jaxtrain.model.loss): the same loss and gradients as
the plain loss, and a compiled program without the (B, L, V) logits."""

import collections
import re

import jax
import numpy as np
import pytest
from flax import nnx

from jaxtrain.core import config
from jaxtrain.core.errors import UserError
from jaxtrain.model import loss as xent, ops, transformer as model_lib
from jaxtrain.parallel import plan as plan_lib
from jaxtrain.run import grads as grads_lib, step
from tests.helpers import mesh_of, with_microbatches


def under(plan, fn):
  """`fn` traced with `plan` installed (as the step installs it)."""
  def run(*args):
    with ops.use(plan):
      return fn(*args)
  return run


def rel(got, want):
  """Largest deviation relative to the largest reference value."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


# ---- the loss alone, against float64 numpy --------------------------------------------

B, L, D, V = 2, 24, 16, 64


@pytest.fixture(scope="module")
def head():
  """Random hidden states, weight, targets and a 0/1 mask; the float64 loss and gradients
  written out by hand (softmax - one_hot)."""
  rng = np.random.default_rng(0)
  h, w = rng.normal(size=(B, L, D)).astype(np.float32), rng.normal(size=(D, V)).astype(np.float32)
  t = rng.integers(0, V, (B, L)).astype(np.int32)
  m = (rng.random((B, L)) > 0.3).astype(np.int32)
  logits = h.astype(np.float64) @ w.astype(np.float64)
  top = logits.max(-1, keepdims=True)
  lse = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[..., 0]
  nll = lse - np.take_along_axis(logits, t[..., None], -1)[..., 0]
  dlogits = (np.exp(logits - lse[..., None]) - np.eye(V)[t]) * m[..., None]
  want = {"loss": float((nll * m).sum()), "h": dlogits @ w.T.astype(np.float64),
          "w": np.einsum("bld,blv->dv", h.astype(np.float64), dlogits)}
  return (h, w, t, m), want


@pytest.mark.parametrize("spec,chunk", [("dp=1", 0), ("dp=1", 5), ("tp=2", 8), ("sp=2,tp=2", 4), ("dp=2,sp=2", 3),
                                        ("fsdp=2,tp=2", 4)])
def test_chunked_vocab_parallel_loss_and_grads_equal_float64(head, spec, chunk):
  (h, w, t, m), want = head
  mesh = mesh_of(spec)
  plan = plan_lib.build(config.load("tiny"), mesh)
  f = jax.jit(under(plan, jax.value_and_grad(lambda h, w: xent.nll_sum(h, w, t, m, chunk), argnums=(0, 1))))
  loss, (dh, dw) = f(h, jax.device_put(w, plan.sharding(("embed", "vocab"), w.shape)))
  if chunk:  # more than one chunk per device, and chunks within each device's share
    sw, n, c = under(plan, lambda: xent.chunk_layout(B, L, chunk))()
    assert n > 1 and sw * n * c == L
  assert abs(float(loss) - want["loss"]) <= 1e-6 * want["loss"]
  assert rel(dh, want["h"]) <= 1e-6 and rel(dw, want["w"]) <= 1e-6
  alone = jax.jit(under(plan, lambda h, w: xent.nll_sum(h, w, t, m, chunk)))(h, w)  # no gradient taken: eval's path
  assert abs(float(alone) - want["loss"]) <= 1e-6 * want["loss"]


def test_chunk_layout_keeps_within_the_budget_and_divides_the_length():
  assert xent.chunk_layout(4, 32, 16) == (1, 8, 4)  # one device: 4 rows x 4 positions
  assert xent.chunk_layout(1, 24, 10) == (1, 3, 8)  # largest divisor of 24 <= 10
  assert xent.chunk_layout(8, 16, 4) == (1, 16, 1)  # rows alone exceed the budget: one position
  sp = plan_lib.build(config.load("tiny"), mesh_of("dp=2,sp=4"))
  assert under(sp, lambda: xent.chunk_layout(4, 32, 8))() == (4, 2, 4)  # 2 local rows x 4 of a device's 8 positions


# ---- the train step's gradients: packed segments, masks, microbatches, loss scale -------

def _batch(bsz, length):
  """Rows of 3, 2 and 1 packed documents, padding (segment 0, masked) and masked targets."""
  rng = np.random.default_rng(1)
  seg = np.ones((bsz, length), np.int32)
  seg[0, 12:], seg[0, 24:] = 2, 3
  seg[2, 20:] = 2
  seg[3, 26:] = 0
  pos = np.zeros_like(seg)
  for r in range(bsz):
    starts = np.r_[0, np.flatnonzero(np.diff(seg[r])) + 1]
    for a, b in zip(starts, np.r_[starts[1:], length]):
      pos[r, a:b] = np.arange(b - a)
  mask = (seg > 0).astype(np.int32)
  mask[1, :7] = 0
  return {"inputs": rng.integers(0, 512, seg.shape), "targets": rng.integers(0, 512, seg.shape), "positions": pos,
          "segment_ids": seg, "loss_mask": mask}


@pytest.fixture(scope="module")
def train_grads():
  """(spec, tied, chunk) -> (loss, grads) of the gradient contract over 2 microbatches at loss scale 4."""
  batch = _batch(4, 32)
  cache = {}

  def run(spec, tied, chunk):
    if (spec, tied, chunk) not in cache:
      cfg = config.load("tiny", ["model.dtype=float32", "train.batch_size=4", "train.seq_len=32",
                                 f"model.tie_embeddings={str(tied).lower()}", f"train.loss_chunk_tokens={chunk}"])
      setup = step.Setup(cfg, mesh_of(spec))
      params = jax.device_put(nnx.to_pure_dict(nnx.state(model_lib.Transformer(cfg.model, nnx.Rngs(0)))),
                              setup.state_shardings["params"])
      objective = grads_lib.Objective(setup.graphdef, with_microbatches(setup.cfg, 2))
      g = jax.jit(under(setup.plan, lambda p, b: grads_lib.grads(objective, p, b, 4.0)[:2]))
      cache[spec, tied, chunk] = jax.device_get(g(params, setup.device_batch(batch)))
    return cache[spec, tied, chunk]
  return run


@pytest.mark.parametrize("spec,tied", [("dp=1", False), ("tp=2", False), ("tp=2", True)])
def test_train_step_grads_with_chunks_equal_the_plain_loss(train_grads, spec, tied):
  """8 tokens per chunk: 4 chunks per microbatch. Reference: the plain loss on the same mesh
  (sharded against one device is test_parity's). Gradients leaf by leaf, by their norm."""
  ref_loss, ref = train_grads(spec, tied, 0)
  loss, got = train_grads(spec, tied, 8)
  assert abs(float(loss) - float(ref_loss)) <= 1e-6 * float(ref_loss)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(ref)):
    err = np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)
    assert err <= 1e-6, f"{jax.tree_util.keystr(path)}: {err:.2e}"


def test_compiled_step_gathers_the_output_weight_once_and_reduces_its_gradient_once():
  """fsdp=4, 4 chunks per device: per step, one all-gather of the (D, V) output weight and one
  reduction (all-reduce or reduce-scatter) of its gradient, counted in the compiled program with
  loop trip counts; not one per chunk, and no logits matmul recomputed for the backward pass."""
  from jaxtrain.analysis import gpu_compile as gc
  cfg = config.load("tiny", ["train.loss_chunk_tokens=128"])  # 4 rows x 128 positions per device
  setup = step.Setup(cfg, mesh_of("fsdp=4"))
  assert under(setup.plan, lambda: xent.chunk_layout(16, 128, 128))()[1] == 4
  hlo = gc.Hlo.parse(setup.step.lower(*gc.abstract_inputs(setup)).compile().as_text())
  D, V = cfg.model.d_model, cfg.model.vocab_size
  head = re.compile(rf"\[({D},{V}|{V},{D})\]")
  count = collections.Counter()
  for i in hlo.instrs:
    kind = i.opcode.removesuffix("-start")
    if kind in gc.COLLECTIVES and head.search(i.shape):
      count[kind] += hlo.times.get(i.computation, 1)
  assert count["all-gather"] == 1, count
  assert count["all-reduce"] + count["reduce-scatter"] == 1, count


# ---- memory and config ------------------------------------------------------------------

def test_compiled_temporaries_fall_by_at_least_the_logits_at_a_32k_vocabulary():
  Bm, Lm, Dm, Vm = 2, 512, 64, 32768
  logits = Bm * Lm * Vm * 4
  plain, chunked = (xent.temp_bytes(Vm, Dm, Bm, Lm, chunk) for chunk in (0, 128))
  assert plain >= logits and plain - chunked >= logits, (plain, chunked, logits)


def test_a_chunk_size_below_automatic_is_a_one_line_error():
  with pytest.raises(UserError, match="loss_chunk_tokens"):
    config.load("tiny", ["train.loss_chunk_tokens=-2"])
  assert config.load("tiny").train.loss_chunk_tokens == -1  # automatic: the plan's choice (parallel.plan.loss_chunk)


# ---- model.head_logits_dtype=bfloat16 (MaxText's head): against float64 with those roundings ----

def _bf16(x):
  return np.asarray(jax.numpy.asarray(x, jax.numpy.bfloat16), np.float64)


@pytest.mark.parametrize("spec,chunk", [("dp=1", 0), ("fsdp=2,tp=2", 4)])
def test_bfloat16_head_logits_round_the_logits_and_their_gradient_once(head, spec, chunk):
  """bfloat16 hidden states and head; float64 reference that rounds the logits and d(loss)/d(logits) to
  bfloat16 and nothing else. The float32 head (the default) misses that reference by the rounding."""
  (h, w, t, m), _ = head
  h16, w64 = _bf16(h), _bf16(w)
  logits = _bf16(h16 @ w64)
  top = logits.max(-1, keepdims=True)
  lse = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[..., 0]
  want_loss = float(((lse - np.take_along_axis(logits, t[..., None], -1)[..., 0]) * m).sum())
  dlogits = _bf16((np.exp(logits - lse[..., None]) - np.eye(V)[t]) * m[..., None])
  want_h, want_w = dlogits @ w64.T, np.einsum("bld,blv->dv", h16, dlogits)
  mesh = mesh_of(spec)
  errs = {}
  for dt in ("bfloat16", "float32"):
    plan = plan_lib.build(config.load("tiny", [f"model.head_logits_dtype={dt}"]), mesh)
    f = jax.jit(under(plan, jax.value_and_grad(lambda h, w: xent.nll_sum(h, w, t, m, chunk, dt), argnums=(0, 1))))
    loss, (dh, dw) = f(h.astype(jax.numpy.bfloat16), jax.device_put(w, plan.sharding(("embed", "vocab"), w.shape)))
    errs[dt] = (abs(float(loss) - want_loss) / want_loss, rel(dh, want_h), rel(dw, want_w))
  # the gradients are summed in float32 and returned rounded to bfloat16 (the compute dtype): 2^-9 in both
  assert errs["bfloat16"][0] <= 1e-6 and errs["bfloat16"][1] <= 4e-3 and errs["bfloat16"][2] <= 4e-3, errs
  assert errs["float32"][0] > 100 * errs["bfloat16"][0], errs


# ---- float16: the chunked head gradient is formed already scaled, as the plain loss's is ----

def test_float16_chunked_head_gradient_is_finite_where_the_plain_one_is():
  """16,384 float16 tokens of one target with h ~ 8: the head weight's gradient column sums to ~ -120,000
  unscaled, past float16's 65,504, but the step differentiates sum * loss_scale / n_valid (here 2048 / 16384): the
  plain loss's autodiff scales d(logits) before its matmul and stays finite, so must the chunked loss (on main it
  summed, cast to float16, then scaled: inf)."""
  N, D2, V2 = 16384, 8, 16
  rng = np.random.default_rng(3)
  h = (8.0 + rng.random((1, N, D2))).astype(np.float16)
  w = (0.01 * rng.normal(size=(D2, V2))).astype(np.float32)
  t, m = np.zeros((1, N), np.int32), np.ones((1, N), np.int32)
  scale = np.float32(2048.0 / N)
  logits = h.astype(np.float64) @ w.astype(np.float64)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  want = np.einsum("bnd,bnv->dv", h.astype(np.float64), scale * (p - np.eye(V2)[t]))
  assert np.abs(want / scale).max() > 65504 > np.abs(want).max()  # unscaled: past float16; scaled: within
  grads = {}
  for chunk in (0, 1024):
    f = jax.jit(jax.grad(lambda h, w: scale * xent.nll_sum(h, w, t, m, chunk, grad_scale=scale), argnums=(0, 1)))
    grads[chunk] = [np.asarray(g, np.float64) for g in f(h, w)]
  for chunk, (dh, dw) in grads.items():
    assert np.isfinite(dw).all() and np.isfinite(dh).all(), chunk
    assert rel(dw, want) <= 2e-3, (chunk, rel(dw, want))  # float16 rounding of d(logits) and of the sum
  np.testing.assert_allclose(grads[1024][0], grads[0][0], rtol=2e-3, atol=1e-6)
