"""cuDNN fused attention (`kernels.fused(..., implementation="cudnn")`, and cuDNN's
packed-offsets layout on Hopper) against the float32 reference: outputs and dQ/dK/dV through
`jax.vjp` with a random cotangent, on unpacked rows and on rows of SEGMENTS documents. The
same `fused` call with the XLA implementation is a control.

Error: max |x - truth| / max |truth| per tensor, truth being
jaxtrain.model.attention.attention in float32 on the same bf16 inputs. A kernel passes when
every error is within max(2 x the bf16 reference's own error, 1e-2)."""

import functools

import pytest

from tests.gpu import checks

SEGMENTS = 4  # documents per row in the packed layout
TENSORS = ("out", "dq", "dk", "dv")


def _run(f, inputs, dtype, seg):
  import jax
  import numpy as np

  def fwd_bwd(q, k, v, g):
    out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, seg), q, k, v)
    return (out, *vjp(g.astype(out.dtype)))
  return [np.asarray(r, np.float32) for r in jax.jit(fwd_bwd)(*(x.astype(dtype) for x in inputs))]


def _rel_errors(got, truth) -> dict:
  import numpy as np
  return {n: float(np.max(np.abs(a - t)) / max(float(np.max(np.abs(t))), 1e-30)) for n, a, t in zip(TENSORS, got, truth)}


@functools.cache
def _reference(tiny: bool, layout: str):
  """Inputs, segment ids, the float32 truth, and the bf16 reference's outputs and errors."""
  import jax.numpy as jnp
  import numpy as np
  from jaxtrain.model import attention
  B, L, H, K, E = checks.shape(tiny)["attention"]
  rng = np.random.default_rng(0)
  inputs = tuple(jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
                 for s in [(B, L, H, E), (B, L, K, E), (B, L, K, E), (B, L, H, E)])  # q, k, v, output cotangent
  seg = (np.ones((B, L), np.int32) if layout == "unpacked" else
         np.repeat(np.arange(1, B * SEGMENTS + 1).reshape(B, SEGMENTS), L // SEGMENTS, axis=1))
  seg = jnp.asarray(seg)
  truth = _run(attention.attention, inputs, jnp.float32, seg)
  ref = _run(attention.attention, inputs, jnp.bfloat16, seg)
  return inputs, seg, truth, ref, _rel_errors(ref, truth)


def _kernel(name, info):
  """(the function, or None and why it does not apply to this device)."""
  from jaxtrain.parallel import kernels
  if name == "xla_fused":
    return (lambda *a: kernels.fused(*a, implementation="xla")), None
  if name == "cudnn":
    return (lambda *a: kernels.fused(*a, implementation="cudnn")), None if info.cuda else "no GPU"
  return ((lambda *a: kernels.packed(*a, max_segments=SEGMENTS)),
          None if info.packed else "no GPU" if not info.cuda else "needs compute capability >= 9.0")


@pytest.mark.parametrize("layout", ["unpacked", "packed"])
@pytest.mark.parametrize("kernel", ["xla_fused", "cudnn", "cudnn_packed_offsets"])
def test_attention_kernel_matches_the_float32_reference(kernel, layout, device, tiny, report):
  import jax.numpy as jnp
  import numpy as np
  from jaxtrain.parallel import devices
  B, L, H, K, E = checks.shape(tiny)["attention"]
  entry = report.setdefault("attention", {"shape": {"B": B, "L": L, "H": H, "K": K, "E": E},
                                          "segments_per_row_packed": SEGMENTS})
  inputs, seg, truth, ref, ref_err = _reference(tiny, layout)
  per = entry.setdefault(layout, {"reference_bf16": {"rel_error": ref_err}})
  f, skip = _kernel(kernel, devices.of(device))
  if skip:
    per[kernel] = {"status": "skipped", "reason": skip}
    pytest.skip(skip)
  got = _run(f, inputs, jnp.bfloat16, seg)
  err = _rel_errors(got, truth)
  bound = {n: max(2 * ref_err[n], 1e-2) for n in TENSORS}
  bad = [n for n in TENSORS if not err[n] <= bound[n]]  # NaN fails too
  per[kernel] = {"status": "failed" if bad else "ok", "rel_error": err,
                 "max_abs_diff_vs_reference_bf16": {n: float(np.max(np.abs(a - r))) for n, a, r in zip(TENSORS, got, ref)}}
  print(f"attention {kernel}/{layout}: max rel error vs f32 {max(err.values()):.2g} "
        f"(bf16 reference {max(ref_err.values()):.2g})")
  assert not bad, f"{kernel} {layout}: " + ", ".join(f"{n} {err[n]:.3g} > {bound[n]:.3g}" for n in bad)


@pytest.mark.parametrize("layout", ["unpacked", "packed"])
@pytest.mark.parametrize("pairs", ["xla_pairs", "cudnn_pairs"])
def test_ring_pairs_merged_match_the_float32_reference(pairs, layout, device, tiny, report):
  """Ring attention's pair kernels (`ring.XLA`, the control, and `ring.CUDNN`) as the ring merges them
  (`ring.two_pairs`: the second half of each row's queries against both halves of its keys), against the float32
  reference on the same rows with the first half's cotangent zero: the merge by log-sum-exp and a backward given
  statistics the kernel did not compute itself, which one device can show. Packed rows: SEGMENTS documents a row,
  each pair given the segment ids."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jaxtrain.model import attention
  from jaxtrain.parallel import devices, ring
  info = devices.of(device)
  if pairs == "cudnn_pairs" and not info.cuda:  # the cuDNN kernel exists only on a CUDA GPU; the report says so
    report.setdefault("ring_pairs", {}).setdefault(layout, {})[pairs] = {"status": "skipped", "reason": "no GPU"}
    pytest.skip("no GPU")
  (q, k, v, g), seg, *_ = _reference(tiny, layout)
  n = q.shape[1] // 2
  g = g.at[:, :n].set(0)
  truth, ref = ([np.array(x) for x in _run(attention.attention, (q, k, v, g), dt, seg)]
                for dt in (jnp.float32, jnp.bfloat16))
  truth, ref = ([t[0][:, n:], t[1][:, n:], t[2], t[3]] for t in (truth, ref))  # out, dq: the second half's rows
  ref_err = _rel_errors(ref, truth)
  blocks = ring.CUDNN if pairs == "cudnn_pairs" else ring.XLA
  got = [np.asarray(x, np.float32) for x in jax.jit(functools.partial(ring.two_pairs, blocks))(
      q, k, v, None if layout == "unpacked" else seg, g)]
  err = _rel_errors(got, truth)
  bound = {n: max(2 * ref_err[n], 1e-2) for n in TENSORS}
  bad = [n for n in TENSORS if not err[n] <= bound[n]]
  report.setdefault("ring_pairs", {}).setdefault(layout, {})[pairs] = {
      "status": "failed" if bad else "ok", "rel_error": err, "check_cudnn": ring.check_cudnn() if info.cuda else None}
  print(f"ring pairs {pairs}/{layout}: max rel error vs f32 {max(err.values()):.2g} (bf16 reference "
        f"{max(ref_err.values()):.2g})")
  assert not bad, f"{pairs} {layout}: " + ", ".join(f"{n} {err[n]:.3g} > {bound[n]:.3g}" for n in bad)
  if info.cuda:
    assert ring.check_cudnn() is None  # the plan's own check agrees
