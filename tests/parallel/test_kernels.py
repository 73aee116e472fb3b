"""Attention kernel choice for the target device (jaxtrain.parallel.kernels), and the packed-segment description
cuDNN gets (checked on CPU: the mask the offsets describe equals the reference's segment mask)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.core import config
from jaxtrain.core.errors import UserError
from jaxtrain.model import attention
from jaxtrain.parallel import devices, kernels, plan as plan_lib
from tests.helpers import trajectory

H100, A100 = devices.of("H100"), devices.of("A100")
CFG = config.load("tiny", ["model.dtype=float32", "model.n_layers=2", "model.d_model=32", "model.d_ff=64",
                           "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=8", "model.vocab_size=64"]).model


def test_selection_follows_the_target_device_not_the_host():
  m = dataclasses.replace(config.load("tiny").model, dtype="bfloat16", attention_max_segments=8)
  assert kernels.select(m, 128, H100) == ("cudnn", "cuDNN fused attention (causal; segments as packed offsets, "
                                                     "at most 8 per row (model.attention_max_segments))", 8)
  assert kernels.select(m, 128, A100)[1].endswith("L x L mask: the packed layout needs a Hopper or newer GPU)")
  assert kernels.select(m, 128, devices.of(jax.devices("cpu")[0]))[0] == "xla"  # what this host is


def test_the_cudnn_path_follows_the_datas_segments_per_row():
  """One segment a row: causal alone (any cuDNN GPU); packed rows: offsets sized by the data where they cost no
  more memory than the mask (2 M heads <= L), or by the user's bound; the mask where nothing else runs, said."""
  m = dataclasses.replace(config.load("tiny").model, dtype="bfloat16")  # 8 heads
  assert kernels.path(m, A100, 2048, 1) == (1, "one document per row: causal alone, no mask")
  assert kernels.path(m, H100, 2048, 1)[0] == 1
  assert kernels.path(m, H100, 2048, 13) == (13, "segments as packed offsets, at most 13 per row (the data's rows)")
  slots, why = kernels.path(m, H100, 128, 13)  # 2 * 13 * 8 > 128: the statistics would outweigh the mask
  assert slots == 0 and "rows hold up to 13 documents" in why and "model.attention_max_segments" in why
  assert kernels.path(m, A100, 2048, 13) == (0, "segments as an L x L mask: the packed layout needs a Hopper or "
                                                "newer GPU")
  assert kernels.path(m, H100, 2048, None)[0] == 0  # not known (no data here): the mask
  bound = dataclasses.replace(m, attention_max_segments=16)
  assert kernels.path(bound, H100, 128, None) == (16, "segments as packed offsets, at most 16 per row "
                                                      "(model.attention_max_segments)")
  assert kernels.path(bound, H100, 128, 13)[0] == 13  # the data's tighter count, the user's bound holds it
  assert kernels.path(bound, H100, 128, 1)[0] == 1
  with pytest.raises(UserError, match="rows of this data hold up to 20 documents but model.attention_max_segments=16"):
    kernels.path(bound, H100, 128, 20)


def _mask_from_offsets(lengths, starts, L):
  """Causal mask that cuDNN's packed layout implies: each (start, length) is its own sequence."""
  seg = np.full(L, -1)
  for k, (n, s) in enumerate(zip(lengths, starts)):
    if n > 0:
      seg[s:s + n] = k
  assert (seg >= 0).all()  # every token belongs to exactly one described segment
  return (seg[:, None] == seg[None, :]) & np.tri(L, dtype=bool)


def test_segment_offsets_describe_exactly_the_reference_mask():
  rng = np.random.default_rng(0)
  L, M = 64, 12
  rows = []
  for _ in range(6):
    cuts = np.sort(rng.choice(np.arange(1, L), size=rng.integers(0, M), replace=False))
    rows.append(np.repeat(np.arange(len(cuts) + 1) + 1, np.diff(np.concatenate([[0], cuts, [L]]))))
  rows[0][-5:] = 0  # trailing padding is a segment of its own, as in the reference
  seg = np.stack(rows).astype(np.int32)
  lengths, starts = (np.asarray(a) for a in jax.jit(kernels.segment_offsets, static_argnums=1)(seg, M))
  assert lengths.shape == (6, M) and starts.shape == (6, M + 1)
  for b in range(6):
    want = (seg[b][:, None] == seg[b][None, :]) & np.tri(L, dtype=bool)
    np.testing.assert_array_equal(_mask_from_offsets(lengths[b], starts[b][:M], L), want)
    used = int(kernels.segments_per_row(seg[b:b + 1])[0])
    assert (lengths[b, used:] == -1).all() and (starts[b, used:] == -1).all()


def test_a_row_with_more_segments_than_the_bound_is_refused():
  class Gpu:
    platform, compute_capability = "gpu", "9.0"
  sets = ["model.dtype=bfloat16", "model.attention_max_segments=3"]
  seg = np.array([[1, 1, 2, 3, 3, 4, 0, 0]], np.int32)  # 5 segments
  plan = plan_lib.build(config.load("tiny", sets), None, device=Gpu())
  assert plan.attention == "cudnn" and plan.packed_segments == 3
  with pytest.raises(UserError, match="holds 5 documents but the attention was planned for at most 3"):
    plan.check_rows(seg)
  plan_lib.build(config.load("tiny", [*sets, "model.attention_max_segments=5"]), None, device=Gpu()).check_rows(seg)
  plan_lib.build(config.load("tiny", sets), None).check_rows(seg)  # this CPU host: the reference kernel, no bound
  causal = plan_lib.build(config.load("tiny", ["model.dtype=bfloat16"]), None, device=Gpu(), segments=1)
  assert causal.packed_segments == 1
  causal.check_rows(np.ones((2, 8), np.int32))
  with pytest.raises(UserError, match="holds 5 documents but the attention was planned for at most 1"):
    causal.check_rows(seg)  # one-document rows were promised: a packed row would be attended across documents


def test_attention_selection_picks_the_reference_on_cpu():
  bf16 = dataclasses.replace(CFG, dtype="bfloat16", head_dim=64)
  impl, reason, _ = kernels.select(bf16, 128)
  assert impl == "xla" and "cpu" in reason
  assert kernels.select(dataclasses.replace(bf16, attention="xla"))[0] == "xla"
  with pytest.raises(UserError, match="model.attention=cudnn is not supported here: backend is cpu"):
    kernels.select(dataclasses.replace(bf16, attention="cudnn"), 128)


def test_attention_selection_rules_on_a_gpu():
  """The conditions, for an A100 target (head_dim at most 128) and an H100 (256)."""
  bf16 = dataclasses.replace(CFG, dtype="bfloat16", head_dim=64)
  assert kernels.select(bf16, 128, info=devices.of("A100"))[0] == "cudnn"
  for cfg, seq, why in [(dataclasses.replace(bf16, dtype="float32"), 128, "model.dtype=float32"),
                        (dataclasses.replace(bf16, head_dim=60), 128, "model.head_dim=60"),
                        (dataclasses.replace(bf16, head_dim=192), 128, "model.head_dim=192"),
                        (bf16, 127, "train.seq_len=127")]:
    impl, reason, _ = kernels.select(cfg, seq, info=devices.of("A100"))
    assert impl == "xla" and why in reason
    with pytest.raises(UserError, match=why):
      kernels.select(dataclasses.replace(cfg, attention="cudnn"), seq, info=devices.of("A100"))
  assert kernels.select(dataclasses.replace(bf16, head_dim=192), 128, info=devices.of("H100"))[0] == "cudnn"


def test_fused_call_masks_segments_like_the_reference():
  """The arguments `fused` gives jax.nn.dot_product_attention (causal + segment mask, GQA),
  run with its XLA implementation, against the model's reference; packed and unpacked."""
  rng = np.random.default_rng(0)
  B, L, H, K, E = 2, 12, 4, 2, 8
  q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in [(B, L, H, E), (B, L, K, E), (B, L, K, E)])
  for seg in (jnp.asarray([[1] * 5 + [2] * 4 + [0] * 3, [1] * 12]), jnp.ones((B, L), jnp.int32)):
    f = lambda q, k, v: kernels.fused(q, k, v, seg, implementation="xla")
    r = lambda q, k, v: attention.attention(q, k, v, seg)
    np.testing.assert_allclose(f(q, k, v), r(q, k, v), rtol=1e-5, atol=1e-5)
    gf = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2))(q, k, v)
    gr = jax.grad(lambda *a: jnp.sum(r(*a) ** 2), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(gf, gr):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_bfloat16_attention_scores_track_float32_over_five_steps():
  sets = ["model.dtype=bfloat16", "train.batch_size=4", "train.seq_len=64", "model.n_layers=2"]
  f32 = trajectory(config.load("tiny", sets), "dp=1", 5)
  bf16 = trajectory(config.load("tiny", [*sets, "model.attention_logits_dtype=bfloat16"]), "dp=1", 5)
  # Measured: largest relative loss difference 3.8e-5 over the 5 steps (bf16 compute either way);
  # asserted at 1e-3 to leave room for other CPUs and XLA versions.
  np.testing.assert_allclose(bf16[:, 0], f32[:, 0], rtol=1e-3)
  assert not np.array_equal(bf16[:, 0], f32[:, 0])  # the switch does change the math
