"""model.fp8=tensorwise on XLA's GPU compiler (compile-only H100s): every projection matmul of the forward and
both of its backward matmuls become cuBLASLt FP8 GEMMs, the LM head stays in bf16, the roofline counts the FP8
GEMMs at the FP8 peak. (Compiled memory FP8 vs bf16, measured on llama3.1-8b: docs/fp8.md.)

Needs the CUDA plugin (the gpu-aot extra)."""

import pytest

from jaxtrain.analysis import gpu_compile, report
from jaxtrain.core import config
from jaxtrain.parallel import devices
from jaxtrain.run import step as step_lib

from tests.helpers import needs_plugin

pytestmark = pytest.mark.slow  # compiles of whole steps, subprocesses: left out of -m 'not slow'


def _compiled(sets):
  setup = step_lib.Setup(config.load("tiny", sets), gpu_compile.mesh("H100", "fsdp=8"))
  compiled, _ = gpu_compile.compile_step(setup)
  return setup, {**gpu_compile.CompiledMemory.of(compiled).fields(),
                 **gpu_compile.analyse(compiled, setup.mesh, setup.cfg.train.seq_len, setup.plan)}


@needs_plugin
def test_tiny_fp8_step_has_an_fp8_gemm_per_projection_matmul_forward_and_backward():
  setup, c = _compiled(["model.fp8=tensorwise"])
  m, t = setup.cfg.model, setup.cfg.train
  projections = 7  # q, k, v, o, gate, up, down
  assert c["gemms"]["fp8"] == {"ops": 3 * projections * m.n_layers, "per_step": 3 * projections * m.n_layers}, c
  assert c["gemms"]["other"]["ops"] == 3  # the LM head: forward, and its two backward matmuls
  # the roofline: FP8 GEMM FLOPs as the shapes give them, at the FP8 peak
  T = t.batch_size * t.seq_len // 8
  per_layer = m.d_model * m.head_dim * (2 * m.n_heads + 2 * m.n_kv_heads) + 3 * m.d_model * m.d_ff
  roof = c["roofline"]
  assert roof["fp8_gemm_flops"] == 3 * 2 * T * per_layer * m.n_layers
  assert roof["peak_fp8_flops"] == devices.TABLE["H100"].peak_fp8_flops == 1979e12  # datasheet, dense
  head = 3 * 2 * T * m.d_model * m.vocab_size  # bf16 cuBLAS GEMMs, which XLA's cost analysis does not see either
  want = (c["cost"]["flops"] + head) / roof["peak_flops"] + roof["fp8_gemm_flops"] / 1979e12
  assert roof["compute_seconds"] == pytest.approx(want, rel=1e-9)
  text = "\n".join(report.render_compiled(c))
  assert f"GEMMs: {3 * projections * m.n_layers} FP8 (cuBLASLt FP8 or f8 operands), 3 other" in text
