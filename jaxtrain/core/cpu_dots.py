"""bfloat16 matmuls on XLA:CPU as XLA:GPU and TPU run them: bfloat16 operands, float32 sums, one rounding
of the result to bfloat16. XLA:CPU's own kernel for a dot with a bfloat16 result is 2-5x slower than its
kernel for the same operands with a float32 result (YNNPACK, measured in docs/performance.md), so every
bfloat16 x bfloat16 -> bfloat16 `dot_general` lowered for CPU becomes that dot with a float32 result and
a convert. The values are those of a float32 sum rounded once (the sums' order may differ in the last bit).
Lowering rules are process-wide: `install` is idempotent and touches the CPU platform only.
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np


@functools.cache
def install() -> bool:
  """Registers the CPU lowering once; False, with a one-line note, where this jax lacks the rule it wraps."""
  try:
    from jax._src.interpreters import mlir  # private (the rule and convert_hlo): re-check on a jax upgrade
    from jax._src.lax.lax import _dot_general_lower as plain
  except ImportError:
    print("note: cannot reach jax's dot_general lowering (jax._src.lax.lax._dot_general_lower, not in this jax); "
          "bfloat16 matmuls on CPU keep XLA's slower bfloat16-result kernel", file=sys.stderr)
    return False

  def lower(ctx, lhs, rhs, **params):
    out_aval, = ctx.avals_out
    a, b = ctx.avals_in[:2]
    if not (out_aval.dtype == a.dtype == b.dtype == jnp.bfloat16 and params.get("precision") is None):
      return plain(ctx, lhs, rhs, **params, platform="cpu")
    sum_aval = out_aval.update(dtype=np.dtype(np.float32))
    out, = plain(ctx.replace(avals_out=[sum_aval]), lhs, rhs, **params, platform="cpu")
    return [mlir.convert_hlo(ctx, out, sum_aval, out_aval)]

  mlir.register_lowering(jax.lax.dot_general_p, lower, platform="cpu")
  return True
