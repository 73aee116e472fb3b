"""bfloat16 matmuls on XLA:CPU (jaxtrain.core.cpu_dots): the start-up of the commands that run steps makes every
bfloat16 dot sum in float32 and round once, in the fast kernel (a dot with a float32 result), not XLA:CPU's slower
bfloat16-result kernel; building a train step's Setup changes nothing process-wide."""

import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain import cli
from tests.helpers import clean_env


def test_bfloat16_dots_sum_in_float32_and_round_once_after_the_cpu_settings():
  cli.cpu_settings()  # what `train`, `bench` and `generate` do on CPU devices (conftest did it already)
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


# run in a fresh process: no setting made before, the suite's own start-up (conftest) installs both
PROBE = """
import ctypes, re, jax, jax.numpy as jnp
from jaxtrain import cli
from jaxtrain.core import config
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.run import step
class Info(ctypes.Structure):
  _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                             "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
libc.mallinfo2.restype = Info
def state():
  x, w = jnp.ones((64, 4096), jnp.bfloat16), jnp.ones((4096, 96), jnp.bfloat16)
  hlo = jax.jit(lambda a, b: a @ b).lower(x, w).compile().as_text()
  types = {m[1]: m[2] for m in re.finditer(r"%(\\S+) = (\\w+)\\[", hlo)}
  dots = sorted({(types.get(a), types.get(b), out)
                 for out, a, b in re.findall(r"= (\\w+)\\[[^=]* dot\\(%([^,\\s]+), %([^,\\s)]+)", hlo)})
  before = libc.mallinfo2().hblkhd
  block = libc.malloc(48 << 20)
  mapped = libc.mallinfo2().hblkhd > before
  libc.free(block)
  return dots == [("bf16", "bf16", "f32")], mapped
step.Setup(config.load("tiny", ["model.dtype=bfloat16"]), mesh_lib.build(mesh_lib.parse("dp=1"), jax.devices()[:1])).step
print(state())
cli.cpu_settings()
print(state())
"""


def test_a_setup_changes_nothing_process_wide_and_the_cpu_settings_do():
  out = subprocess.run([sys.executable, "-c", PROBE], env=clean_env(JAX_PLATFORMS="cpu"), capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  lines = out.stdout.strip().splitlines()
  assert lines == ["(False, True)", "(True, False)"], lines  # (the fast dot, a 48 MiB block freshly mapped)
