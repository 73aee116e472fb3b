"""Ring attention against plain attention (outputs and gradients), and the shape of its program."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.model import attention as attention_lib
from jaxtrain.core import config
from jaxtrain.parallel import ring
from jaxtrain.run import step
from tests.helpers import mesh_of, plan_of

B, L, H, K, E = 2, 32, 4, 2, 8


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in [(B, L, H, E), (B, L, K, E), (B, L, K, E)])
  # Packed rows: segment boundaries that do not line up with the shard or chunk edges, and padding.
  seg = np.ones((B, L), np.int32)
  seg[0, 5:19], seg[0, 19:29], seg[0, 29:] = 2, 3, 0
  seg[1, 11:] = 2
  return q, k, v, jnp.asarray(seg)


def _loss(attn):
  w = jnp.asarray(np.random.default_rng(9).standard_normal((B, L, H, E)), jnp.float32)
  return lambda q, k, v, seg: jnp.sum(attn(q, k, v, seg) * w)


@pytest.mark.parametrize("spec,zigzag", [("sp=2", True), ("sp=4", True), ("sp=4", False), ("dp=2,sp=2,tp=2", True)])
def test_ring_matches_plain_attention(spec, zigzag):
  plan = plan_of(mesh_of(spec))
  assert plan.attention == "ring"
  q, k, v, seg = _inputs()
  ring_fn = lambda q, k, v, seg: ring.ring_attention(q, k, v, seg, plan, zigzag=zigzag)  # noqa: E731
  want = attention_lib.attention(q, k, v, seg)
  got = jax.jit(ring_fn)(q, k, v, seg)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  g_want = jax.grad(_loss(attention_lib.attention), argnums=(0, 1, 2))(q, k, v, seg)
  g_got = jax.jit(jax.grad(_loss(ring_fn), argnums=(0, 1, 2)))(q, k, v, seg)
  for name, a, b in zip("qkv", g_got, g_want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=f"d{name}")


def test_compiled_program_is_a_ring():
  """sp=4: K/V move by collective-permute; nothing gathers a full-length K or V."""
  plan = plan_of(mesh_of("sp=4"))
  q, k, v, seg = _inputs()
  fn = jax.jit(jax.grad(_loss(lambda *a: ring.ring_attention(*a, plan)), argnums=(0, 1, 2)))
  hlo = fn.lower(q, k, v, seg).compile().as_text()
  assert len(re.findall(r"collective-permute(-start)?\(", hlo)) >= 2 * 3  # forward + backward ring hops
  gathers = re.findall(r"= (\S+) all-gather(?:-start)?\(", hlo)
  full_kv = f"[{B},{L},{K},{E}]"
  assert not [g for g in gathers if full_kv in g.replace("f32", "")], gathers
  # The local K block in the ring is L/4 long.
  assert f"f32[{B},{L // 4},{K},{E}]" in hlo


def test_model_uses_the_ring_only_when_the_sequence_is_sharded():
  cfg = config.load("tiny", ["model.dtype=float32", "train.batch_size=4", "train.seq_len=32", "model.n_layers=1"])
  for spec, want in [("sp=4", True), ("dp=4", False)]:
    setup = step.Setup(cfg, mesh_of(spec))
    batch = {k: jax.ShapeDtypeStruct((4, cfg.train.seq_len), jnp.int32, sharding=setup.batch_sharding)
             for k in ("inputs", "targets", "loss_mask", "segment_ids", "positions")}
    hlo = setup.step.lower(jax.eval_shape(setup.init), batch).as_text()
    assert ("collective_permute" in hlo) == want, spec


@pytest.mark.parametrize("rows", ["one document", "packed"])
@pytest.mark.parametrize("spec,zigzag", [("sp=2", True), ("sp=4", True), ("sp=4", False), ("dp=2,sp=2,tp=2", True)])
def test_ring_of_pair_kernels_matches_plain_attention(spec, zigzag, rows):
  """The path cuDNN takes on a GPU (each pair's output and log-sum-exp merged; each pair's backward from the whole
  ring's output and log-sum-exp), run with the XLA pair kernel: against one device's plain attention. Rows of one
  document go without segment ids (the plan's packed_segments 1); packed rows pass them to every pair (documents
  that end mid-block, queries that meet no key of theirs in a pair, padding)."""
  plan = plan_of(mesh_of(spec))
  q, k, v, seg = _inputs(3)
  if rows == "one document":
    plan, seg = dataclasses.replace(plan, packed_segments=1), jnp.ones((B, L), jnp.int32)
  ring_fn = lambda q, k, v, seg: ring.ring_attention(q, k, v, seg, plan, zigzag=zigzag, blocks=ring.XLA)  # noqa
  np.testing.assert_allclose(jax.jit(ring_fn)(q, k, v, seg), attention_lib.attention(q, k, v, seg), rtol=1e-5,
                             atol=1e-5)
  g_want = jax.grad(_loss(attention_lib.attention), argnums=(0, 1, 2))(q, k, v, seg)
  g_got = jax.jit(jax.grad(_loss(ring_fn), argnums=(0, 1, 2)))(q, k, v, seg)
  for name, a, b in zip("qkv", g_got, g_want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=f"d{name}")


def test_pair_kernel_is_cudnn_where_cudnn_runs_for_the_model_and_says_how_it_masks():
  """The plan's choice for a GPU target (no GPU here: the numeric check runs only on one), each reason to keep the
  online softmax, and the plan line's words for rows of one document, of several and of a count not known."""
  from jaxtrain.parallel import devices
  h100, m = devices.of("H100"), config.load("tiny", ["model.dtype=bfloat16"]).model
  assert ring.pair_problem(m, 64, h100) is None
  for sets, why in [(["model.dtype=float32"], "model.dtype=float32"),
                    (["model.dtype=bfloat16", "model.sliding_window=16"], "sliding windows"),
                    (["model.dtype=bfloat16", "model.attention=xla"], "model.attention=xla")]:
    problem = ring.pair_problem(config.load("tiny", sets).model, 64, h100)
    assert problem and why in problem, problem
  assert "not a CUDA GPU" in ring.pair_problem(m, 64, devices.of("cpu"))
  assert "no mask off it" in ring.pair_words(None, 1)
  assert "as a bias: rows hold up to 5 documents" in ring.pair_words(None, 5)
  assert "not known" in ring.pair_words(None, None)
  assert ring.pair_words("sliding windows", 1) == "online softmax over XLA blocks, not cuDNN: sliding windows"


def test_on_a_gpu_cudnn_pairs_that_disagree_with_xla_keep_the_online_softmax(monkeypatch):
  """The numeric check a GPU runs once before the plan takes cuDNN pairs, with stand-ins for cuDNN (no GPU here):
  a pair kernel whose output is off by half, and one that cannot run, each keep the XLA blocks and say why; the
  XLA kernel itself passes."""
  from jaxtrain.parallel import devices
  h100, m = devices.of("H100"), config.load("tiny", ["model.dtype=bfloat16"]).model
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  off = ring.Blocks(lambda *a: (lambda o, s: (o * 1.5, s))(*ring._xla_forward(*a)), ring._xla_backward)
  broken = ring.Blocks(lambda *a: 1 / 0, ring._xla_backward)
  for stand_in, why in [(off, "differ from XLA's in out by"),
                        (broken, "failed their check: ZeroDivisionError"), (ring.XLA, None)]:
    monkeypatch.setattr(ring, "CUDNN", stand_in)
    ring.check_cudnn.cache_clear()
    try:
      problem = ring.pair_problem(m, 64, h100)
    finally:
      ring.check_cudnn.cache_clear()
    assert problem is None if why is None else why in problem, problem


def test_ring_of_pair_kernels_with_a_narrower_v_matches_plain_attention():
  """MLA's v is narrower than q and k: the pairs' outputs and the merge take v's width (cuDNN's pairs pad it)."""
  plan = plan_of(mesh_of("sp=2"))
  q, k, v, seg = _inputs(5)
  v = v[..., : E // 2]
  ring_fn = lambda q, k, v, seg: ring.ring_attention(q, k, v, seg, plan, blocks=ring.XLA)  # noqa: E731
  np.testing.assert_allclose(jax.jit(ring_fn)(q, k, v, seg), attention_lib.attention(q, k, v, seg), rtol=1e-5,
                             atol=1e-5)
  w = jnp.asarray(np.random.default_rng(9).standard_normal((B, L, H, E // 2)), jnp.float32)
  loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v, seg) * w)  # noqa: E731
  for name, a, b in zip("qkv", jax.jit(jax.grad(loss(ring_fn), argnums=(0, 1, 2)))(q, k, v),
                        jax.grad(loss(attention_lib.attention), argnums=(0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=f"d{name}")
