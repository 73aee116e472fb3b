"""bfloat16 matmuls on XLA:CPU (jaxtrain.model.cpu_dots): the train step's setup makes every bfloat16 dot
sum in float32 and round once, in the fast kernel (a dot with a float32 result), not XLA:CPU's slower
bfloat16-result kernel."""

import re

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.core import config
from jaxtrain.run import step
from tests.helpers import mesh_of


def test_bfloat16_dots_sum_in_float32_and_round_once_after_the_step_setup():
  step.Setup(config.load("tiny"), mesh_of("dp=1"))
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(64, 4096)), jnp.bfloat16)
  w = jnp.asarray(rng.normal(size=(4096, 96)) * 0.05, jnp.bfloat16)
  f = jax.jit(lambda x, w: (x @ w, jnp.einsum("md,dn->mn", x, w)))
  hlo = f.lower(x, w).compile().as_text()
  # each dot's operand and result types: bfloat16 operands, float32 result (XLA:CPU alone gives this dot a
  # bfloat16 result, or float32 operands converted from the bfloat16 ones, for other shapes)
  types = {m[1]: m[2] for m in re.finditer(r"%(\S+) = (\w+)\[", hlo)}
  dots = [(types.get(a), types.get(b), out) for out, a, b in re.findall(r"= (\w+)\[[^=]* dot\(%([^,\s]+), %([^,\s)]+)", hlo)]
  assert dots and set(dots) == {("bf16", "bf16", "f32")}, dots
  want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  for got in f(x, w):
    got = np.asarray(got, np.float64)
    ulp = np.abs(np.asarray(jnp.asarray(want, jnp.bfloat16), np.float64) - got)
    # rounded once from a float32 sum: the float64 product rounded to bfloat16, but where the float32 sum
    # lands by a hair on the other side of a rounding boundary (one bfloat16 step, rarely)
    assert np.mean(ulp > 0) < 1e-2 and np.all(ulp <= np.abs(want) * 2.0**-7 + 1e-6)
