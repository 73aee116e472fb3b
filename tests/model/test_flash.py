"""The blocked one-device attention (jaxtrain.model.flash): outputs and gradients (q, k, v, sinks) against a float64
numpy masked softmax (tests/parallel/test_windows.py's `plain`, its gradients written out here) and against the
XLA reference; the plan's choice of it (kernels.select), a train step with it on a mesh against the reference on
one device, the compiled program holding no L x L buffer, and its memory bill."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.analysis import memory
from jaxtrain.core import config
from jaxtrain.model import attention as attention_lib, flash
from jaxtrain.parallel import devices, kernels, plan as plan_lib
from tests.helpers import mesh_of, plan_of, trajectory
from tests.parallel.test_windows import inputs, plain


def plain_grads(q, k, v, seg, w, window=0, sinks=None):
  """Gradients of sum(plain(q, k, v) * w) in numpy, float64: (dq, dk, dv, dsinks) by the softmax's own chain rule
  (dS = P (dP - rowsum(dP P))), the sink being one more column of P whose value is not used."""
  q, k, v, w = (np.asarray(x, np.float64) for x in (q, k, v, w))
  seg = np.asarray(seg)
  B, L, H, E = q.shape
  G = H // k.shape[2]
  i, j = np.arange(L)[:, None], np.arange(L)[None, :]
  ok = (j <= i) & ((i - j < window) if window else True)
  dq, dk, dv, ds = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v), np.zeros(H)
  for b in range(B):
    for h in range(H):
      kh = h // G
      s = np.where(ok & (seg[b][:, None] == seg[b][None, :]), q[b, :, h] @ k[b, :, kh].T / np.sqrt(E), -np.inf)
      top = np.maximum(s.max(-1, keepdims=True), -1e300 if sinks is None else sinks[h])
      p = np.exp(s - top)
      sink = np.zeros((L, 1)) if sinks is None else np.exp(sinks[h] - top)
      den = p.sum(-1, keepdims=True) + sink
      p, p_sink = p / den, sink / den
      dp = w[b, :, h] @ v[b, :, kh].T
      row = (dp * p).sum(-1, keepdims=True)  # d loss / d (sink's column) is 0: its value is not used
      dsc = p * (dp - row) / np.sqrt(E)
      dv[b, :, kh] += p.T @ w[b, :, h]
      dq[b, :, h] = dsc @ k[b, :, kh]
      dk[b, :, kh] += dsc.T @ q[b, :, h]
      ds[h] += (-p_sink[:, 0] * row[:, 0]).sum()
  return dq, dk, dv, ds


# blocks of 4: 8 of them; of 5: 7 with 3 padded tokens; of 32: one. Windows within a block, across a few, or wider
@pytest.mark.parametrize("window,block,with_sinks", [(0, 4, True), (3, 5, True), (8, 4, False), (20, 5, True),
                                                     (9, 32, True), (1, 4, False)])
def test_blocked_equals_float64_masked_softmax_and_the_reference(window, block, with_sinks):
  """Packed rows (segments whose edges miss the block edges, padding), windows shorter and longer than a block."""
  q, k, v, seg, sinks = inputs()
  s = sinks if with_sinks else None
  w = jnp.asarray(np.random.default_rng(9).standard_normal(q.shape), jnp.float32)
  blocked = lambda q, k, v, s: jnp.sum(flash.attention(q, k, v, seg, window, s, block) * w)  # noqa: E731
  reference = lambda q, k, v, s: jnp.sum(attention_lib.attention(q, k, v, seg, window=window, sinks_H=s) * w)  # noqa: E731
  got = jax.jit(lambda q, k, v, s: flash.attention(q, k, v, seg, window, s, block))(q, k, v, s)
  np.testing.assert_allclose(got, plain(q, k, v, seg, window, None if s is None else np.asarray(s)), atol=2e-5)
  args = (0, 1, 2, 3) if with_sinks else (0, 1, 2)
  g_got = jax.jit(jax.grad(blocked, argnums=args))(q, k, v, s)
  g_ref = jax.grad(reference, argnums=args)(q, k, v, s)
  g_plain = plain_grads(q, k, v, seg, w, window, None if s is None else np.asarray(s))
  for name, a, b, c in zip(["q", "k", "v", "sinks"], g_got, g_plain, g_ref):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=f"d{name} against float64")
    np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-4, err_msg=f"d{name} against the reference")


def test_select_chooses_blocked_where_cudnn_cannot_at_long_sequences():
  m = config.load("tiny", ["model.attention_sinks=true"]).model
  h100, cpu = devices.of("H100"), devices.of("cpu")
  impl, why, _ = kernels.select(m, 4096, h100)
  assert impl == "blocked" and "attention_sinks" in why and "512 x 512" in why, why
  assert kernels.select(m, 512, h100)[0] == "xla"  # one block: the reference is the same work
  assert kernels.select(m, 4096, cpu)[0] == "xla"
  assert kernels.select(dataclasses.replace(m, attention_sinks=False), 4096, h100)[0] == "cudnn"
  assert kernels.select(dataclasses.replace(m, attention="xla"), 4096, h100)[0] == "xla"
  assert kernels.select(dataclasses.replace(m, attention="blocked"), 64, cpu)[0] == "blocked"


@pytest.mark.slow
def test_compiled_blocked_attention_holds_no_LxL_buffer():
  """At L = 8192 one head's float32 L x L scores are 256 MiB: the plan for an H100 with sinks compiles a backward
  whose temporaries are a few MiB (the reference's exceed L x L), and the bill's blocked workspace bounds them."""
  B, L, H, K, E = 1, 8192, 2, 1, 16
  plan = plan_lib.build(config.load("tiny", ["model.attention_sinks=true", f"train.seq_len={L}",
                                             f"model.n_heads={H}", f"model.n_kv_heads={K}", f"model.head_dim={E}"]),
                        None, device="H100")
  assert plan.attention == "blocked", plan.attention_why
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
  seg = jax.ShapeDtypeStruct((B, L), jnp.int32)
  fn = jax.grad(lambda q, k, v, seg, s: jnp.sum(plan.attend(q, k, v, seg, window=0, sinks_H=s) ** 2),
                argnums=(0, 1, 2, 4))
  temp = jax.jit(fn).lower(f32(B, L, H, E), f32(B, L, K, E), f32(B, L, K, E), seg, f32(H)).compile(
      ).memory_analysis().temp_size_in_bytes
  assert temp < L * L * 4 / 16, temp
  bill = memory.blocked_workspace(dict(T=B * L, H=H, R=K, E=E, L=L))
  assert temp <= bill, (temp, bill)


def test_the_bill_counts_blocks_not_LxL():
  """gpt-oss-20b on 8 H100s with FSDP (docs/gpt-oss.md): the plan takes the blocked kernel, whose layer phase is
  far below the reference's L x L one."""
  cfg = config.load("gpt-oss-20b")
  mesh = mesh_of("fsdp=8")
  plan = plan_lib.build(cfg, mesh, device="H100")
  assert plan.attention == "blocked"
  phase = lambda kernel: memory.workspace(cfg, mesh, cfg.model.remat, kernel)["layer phase"]  # noqa: E731
  rest = phase("ring")  # the same residuals (float32 statistics per row), no workspace of its own here
  scores = 64 // 8 * cfg.model.n_heads * cfg.train.seq_len ** 2 * 4  # one layer's float32 L x L, 8 rows a device
  assert phase("xla") - rest > scores > 8 * (phase("blocked") - rest) > 0


@pytest.mark.slow
def test_train_step_with_blocked_on_a_mesh_equals_the_reference_on_one_device():
  """fsdp=2,tensor=2 (heads split in the kernel's shard_map), sinks, an alternating window, packed documents:
  losses and gradient norms of the blocked kernel equal the XLA reference on one device."""
  sets = ["model.attention_sinks=true", "model.sliding_window=24", "model.layer_types=alternate",
          "model.dtype=float32", "train.seq_len=128", "train.batch_size=8"]
  want = trajectory(config.load("tiny", sets + ["model.attention=xla"]), "dp=1", 2)
  got = trajectory(config.load("tiny", sets + ["model.attention=blocked"]), "fsdp=2,tp=2", 2)
  np.testing.assert_allclose(got, want, rtol=2e-5)


def test_blocked_inside_ulysses_equals_the_reference():
  """Ulysses runs the plan's kernel inside its own shard_map (which checks how values vary over the mesh): the
  blocked kernel's loops there, outputs and gradients against the reference."""
  plan = plan_of(mesh_of("sp=2,tp=2"), "model.sequence_attention=ulysses", "model.n_heads=4", "model.n_kv_heads=2",
                 "model.attention=blocked", "train.seq_len=32")
  assert plan.ulysses and plan.attention == "blocked"
  q, k, v, seg, sinks = inputs()
  fn = lambda q, k, v, s: plan.attend(q, k, v, seg, window=6, sinks_H=s)  # noqa: E731
  ref = lambda q, k, v, s: attention_lib.attention(q, k, v, seg, window=6, sinks_H=s)  # noqa: E731
  np.testing.assert_allclose(jax.jit(fn)(q, k, v, sinks), plain(q, k, v, seg, 6, np.asarray(sinks)), atol=2e-5)
  loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)  # noqa: E731
  got = jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
  want = jax.grad(loss(ref), argnums=(0, 1, 2, 3))(q, k, v, sinks)
  for name, a, b in zip(["q", "k", "v", "sinks"], got, want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=f"d{name}")
