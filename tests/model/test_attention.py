"""Kernel choice for the target device, and the packed-segment description cuDNN gets
(checked on CPU: the mask the offsets describe equals the reference's segment mask)."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxtrain.model import attention
from jaxtrain.core import config
from jaxtrain.parallel import plan as plan_lib
from jaxtrain.core.errors import UserError
from jaxtrain.parallel import devices

H100, A100 = devices.of("H100"), devices.of("A100")


def test_selection_follows_the_target_device_not_the_host():
  m = dataclasses.replace(config.load("tiny").model, dtype="bfloat16", attention_max_segments=8)
  assert attention.select(m, 128, H100) == ("cudnn", "cuDNN fused attention (causal; segments as packed offsets, "
                                                     "at most 8 per row)")
  assert attention.select(m, 128, A100)[1].endswith("segments as an L x L mask)")  # packed needs Hopper
  assert attention.select(m, 128, devices.of(jax.devices("cpu")[0]))[0] == "xla"  # what this host is


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
  lengths, starts = (np.asarray(a) for a in jax.jit(attention.segment_offsets, static_argnums=1)(seg, M))
  assert lengths.shape == (6, M) and starts.shape == (6, M + 1)
  for b in range(6):
    want = (seg[b][:, None] == seg[b][None, :]) & np.tri(L, dtype=bool)
    np.testing.assert_array_equal(_mask_from_offsets(lengths[b], starts[b][:M], L), want)
    used = int(attention.segments_per_row(seg[b:b + 1])[0])
    assert (lengths[b, used:] == -1).all() and (starts[b, used:] == -1).all()


def test_a_row_with_more_segments_than_the_bound_is_refused():
  class Gpu:
    platform, compute_capability = "gpu", "9.0"
  sets = ["model.dtype=bfloat16", "model.attention_max_segments=3"]
  seg = np.array([[1, 1, 2, 3, 3, 4, 0, 0]], np.int32)  # 5 segments
  plan = plan_lib.build(config.load("tiny", sets), None, device=Gpu())
  assert plan.attention == "cudnn" and plan.packed_segments == 3
  with pytest.raises(UserError, match="holds 5 documents but model.attention_max_segments=3"):
    plan.check_rows(seg)
  plan_lib.build(config.load("tiny", [*sets, "model.attention_max_segments=5"]), None, device=Gpu()).check_rows(seg)
  plan_lib.build(config.load("tiny", sets), None).check_rows(seg)  # this CPU host: the reference kernel, no bound
