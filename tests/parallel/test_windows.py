"""Sliding windows and attention sinks (model.sliding_window, model.layer_types, model.attention_sinks) in every
attention kernel, against a plain masked softmax written here: the reference kernel, jax's fused attention (the
cuDNN call's masking, run by XLA on CPU), ring attention (outputs, gradients, and the ring steps a window skips),
ulysses, and KV-cached decoding whose local layers keep only their window."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.model import attention as attention_lib
from jaxtrain.parallel import kernels, ring
from tests.helpers import mesh_of, plan_of

B, L, H, K, E = 2, 32, 4, 2, 8


def plain(q, k, v, seg, window=0, sinks=None):
  """Masked softmax attention in numpy, float64: key j visible to query i when j <= i, i - j < window (window > 0)
  and both are in one segment; a head's sink adds exp(sink) to its denominator."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  seg = np.asarray(seg)
  i, j = np.arange(q.shape[1])[:, None], np.arange(k.shape[1])[None, :]
  ok = (j <= i) & ((i - j < window) if window else True)
  out = np.zeros_like(q)
  for b in range(q.shape[0]):
    for h in range(q.shape[2]):
      kh = h // (q.shape[2] // k.shape[2])
      s = q[b, :, h] @ k[b, :, kh].T / np.sqrt(q.shape[-1])
      s = np.where(ok & (seg[b][:, None] == seg[b][None, :]), s, -np.inf)
      top = np.maximum(s.max(-1, keepdims=True), -1e300 if sinks is None else sinks[h])
      p = np.exp(s - top)
      den = p.sum(-1, keepdims=True) + (0 if sinks is None else np.exp(sinks[h] - top))
      out[b, :, h] = (p / den) @ v[b, :, kh]
  return out


def inputs(seed=0):
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in [(B, L, H, E), (B, L, K, E), (B, L, K, E)])
  seg = np.ones((B, L), np.int32)  # packed rows whose boundaries miss the shard edges, and padding
  seg[0, 5:19], seg[0, 19:29], seg[0, 29:] = 2, 3, 0
  seg[1, 11:] = 2
  sinks = jnp.asarray(rng.standard_normal(H), jnp.float32)
  return q, k, v, jnp.asarray(seg), sinks


@pytest.mark.parametrize("window", [1, 3, 8, 20])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_reference_kernel_equals_plain_masked_softmax(window, with_sinks):
  q, k, v, seg, sinks = inputs()
  s = sinks if with_sinks else None
  got = attention_lib.attention(q, k, v, seg, window=window, sinks_H=s)
  np.testing.assert_allclose(got, plain(q, k, v, seg, window, None if s is None else np.asarray(s)), atol=2e-5)


@pytest.mark.parametrize("window", [1, 5, 16])
def test_fused_kernel_carries_the_window(window):
  """jax.nn.dot_product_attention with the window the cuDNN path passes (XLA on CPU runs its masking)."""
  q, k, v, seg, _ = inputs()
  for s in (seg, None):
    got = kernels.fused(q, k, v, s, implementation="xla", window=window)
    np.testing.assert_allclose(got, plain(q, k, v, np.ones((B, L)) if s is None else seg, window), atol=2e-5)


def _loss(attn, with_sinks):
  w = jnp.asarray(np.random.default_rng(9).standard_normal((B, L, H, E)), jnp.float32)
  return lambda q, k, v, seg, sinks: jnp.sum(attn(q, k, v, seg, sinks if with_sinks else None) * w)


@pytest.mark.parametrize("spec,window,with_sinks", [("sp=4", 5, False), ("sp=4", 12, True), ("sp=2", 20, True),
                                                    ("sp=4", 0, True), ("dp=2,sp=2,tp=2", 9, True)])
def test_ring_equals_the_reference_with_windows_and_sinks(spec, window, with_sinks):
  plan = plan_of(mesh_of(spec))
  q, k, v, seg, sinks = inputs()
  ring_fn = lambda q, k, v, seg, s: ring.ring_attention(q, k, v, seg, plan, window=window, sinks_H=s)  # noqa: E731
  ref_fn = lambda q, k, v, seg, s: attention_lib.attention(q, k, v, seg, window=window, sinks_H=s)  # noqa: E731
  got = jax.jit(ring_fn)(q, k, v, seg, sinks if with_sinks else None)
  np.testing.assert_allclose(got, plain(q, k, v, seg, window, np.asarray(sinks) if with_sinks else None), atol=2e-5)
  args = (0, 1, 2, 4) if with_sinks else (0, 1, 2)
  g_want = jax.grad(_loss(ref_fn, with_sinks), argnums=args)(q, k, v, seg, sinks)
  g_got = jax.jit(jax.grad(_loss(ring_fn, with_sinks), argnums=args))(q, k, v, seg, sinks)
  for name, a, b in zip(["q", "k", "v", "sinks"], g_got, g_want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=f"d{name}")


def test_a_window_skips_the_ring_steps_and_tiles_outside_it():
  """sp=4, blocks of 8 tokens: step t brings keys at least 8 (t - 1) + 1 back, so windows up to 9 need one hop, up
  to 17 two; without one, three. At 256 tokens (blocks of 64) a window of 16 sends K/V once each way instead of
  three times, and computes query tiles of 16 over the keys they may see: its FLOPs fall below a quarter."""
  assert [ring.ring_steps(8, 4, w) for w in (0, 1, 2, 9, 10, 17, 18)] == [3, 0, 1, 1, 2, 2, 3]
  plan = plan_of(mesh_of("sp=4"))
  rng = np.random.default_rng(0)
  n = 256
  q, k, v = (jnp.asarray(rng.standard_normal((1, n, h, E)), jnp.float32) for h in (H, K, K))
  seg = jnp.ones((1, n), jnp.int32)
  permutes, flops = {}, {}
  for window in (0, 16):
    fn = jax.jit(jax.grad(lambda q, k, v, w=window: jnp.sum(ring.ring_attention(q, k, v, seg, plan, window=w) ** 2),
                          argnums=(0, 1, 2)))
    compiled = fn.lower(q, k, v).compile()
    hlo = compiled.as_text()
    permutes[window] = hlo.count("collective-permute(") + hlo.count("collective-permute-start(")
    flops[window] = compiled.cost_analysis()["flops"]
    if window:
      got = jax.grad(lambda q, k, v: jnp.sum(attention_lib.attention(q, k, v, seg, window=16) ** 2),
                     argnums=(0, 1, 2))(q, k, v)
      for a, b in zip(fn(q, k, v), got):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
  assert permutes[16] < permutes[0], permutes
  assert flops[16] < 0.25 * flops[0], flops


@pytest.mark.parametrize("spec", ["sp=2", "sp=2,tp=2"])
def test_ulysses_equals_the_reference_with_a_window_and_sinks(spec):
  """Heads resharded over sequence (and tensor): each device's kernel gets the window and its heads' sinks."""
  plan = plan_of(mesh_of(spec), "model.sequence_attention=ulysses", "model.n_heads=4", "model.n_kv_heads=2")
  assert plan.ulysses
  q, k, v, seg, sinks = inputs()
  fn = lambda q, k, v, seg, s: plan.attend(q, k, v, seg, window=6, sinks_H=s)  # noqa: E731
  np.testing.assert_allclose(jax.jit(fn)(q, k, v, seg, sinks), plain(q, k, v, seg, 6, np.asarray(sinks)), atol=2e-5)
  ref_fn = lambda q, k, v, seg, s: attention_lib.attention(q, k, v, seg, window=6, sinks_H=s)  # noqa: E731
  g_want = jax.grad(_loss(ref_fn, True), argnums=(0, 1, 2, 4))(q, k, v, seg, sinks)
  g_got = jax.jit(jax.grad(_loss(fn, True), argnums=(0, 1, 2, 4)))(q, k, v, seg, sinks)
  for name, a, b in zip(["q", "k", "v", "sinks"], g_got, g_want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=f"d{name}")


@pytest.mark.slow  # 20 s: the inner loop (-m 'not slow') keeps under 5 minutes
def test_decoding_keeps_a_local_layers_window_and_equals_the_full_forward():
  """Alternate local/global layers with sinks, scanned: the local layers' caches hold the window (3 slots), the
  global ones every position, and prompt-then-token decoding gives the full forward's logits."""
  from flax import nnx

  from jaxtrain.core import config
  from jaxtrain.interop import decode
  from jaxtrain.model import transformer as model_lib
  sets = ["model.dtype=float32", "model.n_layers=4", "model.sliding_window=3", "model.layer_types=alternate",
          "model.attention_sinks=true", "model.scan_layers=true"]
  cfg = config.load("tiny", sets)
  model = model_lib.Transformer(cfg.model, nnx.Rngs(0))
  _, state = nnx.split(model)
  sinks = state["layers"]["attn"]["sinks"]
  sinks.set_value(jnp.asarray(np.random.default_rng(1).standard_normal(sinks.shape), jnp.float32))
  nnx.update(model, state)
  n, S = 12, 16
  tok = jnp.asarray(np.random.default_rng(0).integers(1, 500, (2, n)), jnp.int32)
  pos, seg = jnp.broadcast_to(jnp.arange(n), (2, n)), jnp.ones((2, n), jnp.int32)
  cache = model_lib.init_cache(cfg.model, 2, S)
  assert [kv["k"].shape[1] for kv in cache["layers"]] == [3, S, 3, S]
  logits, cache = model.decode(tok[:, :5], pos[:, :5], seg[:, :5], cache)  # a prompt longer than the window
  out = [logits]
  for t in range(5, n):
    logits, cache = model.decode(tok[:, t:t + 1], pos[:, t:t + 1], seg[:, t:t + 1], cache)
    out.append(logits)
  full = model(tok, pos, seg)
  np.testing.assert_allclose(jnp.concatenate(out, 1), full, atol=2e-5)
  no_window = config.load("tiny", sets[:2] + sets[4:])
  assert decode.cache_bytes(cfg, S) < decode.cache_bytes(no_window, S)
  assert "2 local layer(s) keep their last 3 tokens" in decode.cache_words(cfg, S)


def test_flops_count_a_local_layers_window():
  """The MFU formula's attention term against the visible (query, key) pairs counted here: a local layer of a
  window W at seq_len L attends to what the mask shows, a global one to the causal half."""
  from jaxtrain.core import config
  from jaxtrain.model import flops
  L, W = 64, 9
  cfg = config.load("tiny", ["model.n_layers=4", f"model.sliding_window={W}", "model.layer_types=5:1"])
  none = config.load("tiny", ["model.n_layers=4"])
  i, j = np.arange(L)[:, None], np.arange(L)[None, :]
  local, causal = ((j <= i) & (i - j < W)).sum() / L, L / 2  # the formula's own causal convention: L/2 keys
  per_key = 3 * 2 * cfg.model.n_heads * 2 * cfg.model.head_dim  # QK^T and PV, forward and backward
  drop = flops.flops_per_token(none.model, L) - flops.flops_per_token(cfg.model, L)
  assert cfg.model.layer_windows() == (W, W, W, W)  # 5:1 over 4 layers: all local
  assert drop == pytest.approx(4 * (causal - local) * per_key)


def test_on_a_gpu_target_sinks_take_the_reference_kernel_and_the_plan_says_why():
  """jax's cuDNN attention has no sink logits: auto picks the reference kernel and names the reason; cudnn asked
  for is one line. A window alone stays on cuDNN, whose plan line names it."""
  import dataclasses

  from jaxtrain.core import config
  from jaxtrain.core.errors import UserError
  from jaxtrain.parallel import devices
  m = config.load("tiny", ["model.dtype=bfloat16", "model.sliding_window=64"]).model
  impl, why, _ = kernels.select(m, 128, devices.of("H100"), segments=1)
  assert impl == "cudnn" and "sliding window 64" in why
  impl, why, _ = kernels.select(dataclasses.replace(m, attention_sinks=True), 128, devices.of("H100"), segments=1)
  assert impl == "xla" and "model.attention_sinks=true" in why
  with pytest.raises(UserError, match="model.attention=cudnn is not supported here: model.attention_sinks=true"):
    kernels.select(dataclasses.replace(m, attention_sinks=True, attention="cudnn"), 128, devices.of("H100"))


@pytest.mark.slow  # two whole-step compiles
def test_a_scanned_stack_of_mixed_layers_trains_on_the_ring_as_on_one_device():
  """Alternate local/global layers with sinks in one scanned stack, sp=4 (the ring, switching kernels per layer):
  3 steps equal the one-device run."""
  from jaxtrain.core import config
  from tests.helpers import trajectory
  cfg = config.load("tiny", ["model.dtype=float32", "model.n_layers=4", "model.scan_layers=true",
                             "model.sliding_window=12", "model.layer_types=alternate", "model.attention_sinks=true",
                             "train.batch_size=4", "train.seq_len=64"])
  ref = trajectory(cfg, "dp=1", 3)
  assert ref[-1, 0] < ref[0, 0]
  np.testing.assert_allclose(trajectory(cfg, "sp=4", 3), ref, rtol=1e-5)
