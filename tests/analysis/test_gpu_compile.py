"""XLA's GPU compiler on compile-only H100s (jaxtrain.analysis.gpu_compile): memory, remat, cuDNN
attention, FSDP gathers, a multi-host hybrid mesh, and the fallback without the plugin.

Needs the CUDA plugin (the gpu-aot extra); without it everything but the fallback skips."""

import json
import subprocess
import sys

import pytest

from jaxtrain.core import config
from jaxtrain.analysis import gpu_compile
from jaxtrain.analysis import report
from jaxtrain.analysis import memory
from jaxtrain.run import step as step_lib

from tests.helpers import needs_plugin

pytestmark = pytest.mark.slow  # compiles of whole steps, subprocesses: left out of -m 'not slow'

# A 2-layer llama3-8b-shaped model: real layer widths, two scanned layers. L = 1536 equals
# no other dimension, so an array with two dimensions of 1536 is an L x L buffer.
L8B = ["model.n_layers=2", "model.scan_layers=true", "train.seq_len=1536", "train.batch_size=8",
       "model.attention_max_segments=16"]
TINY_BF16 = ["model.dtype=bfloat16", "train.seq_len=96", "train.batch_size=8", "model.attention_max_segments=8"]


def _compiled(name, sets, spec="fsdp=8"):
  """(setup, inspect's `compiled` object) for the config on compile-only H100s."""
  setup = step_lib.Setup(config.load(name, sets), gpu_compile.mesh("H100", spec))
  return setup, report.compiled_memory(setup)


def _compiled_with_hlo(name, sets, spec="fsdp=8"):
  """(setup, `compiled` object as inspect builds it, parsed HLO) from one compile."""
  setup = step_lib.Setup(config.load(name, sets), gpu_compile.mesh("H100", spec))
  compiled, _ = gpu_compile.compile_step(setup)
  c = {**gpu_compile.CompiledMemory.of(compiled).fields(), **gpu_compile.analyse(compiled, setup.mesh, setup.cfg.train.seq_len, setup.plan)}
  return setup, c, gpu_compile.Hlo.parse(compiled.as_text())


@pytest.fixture(scope="module")
def l8b_full():
  return _compiled_with_hlo("llama3-8b", L8B + ["model.remat=full"])


@pytest.fixture(scope="module")
def tiny_packed():
  return _compiled("tiny", TINY_BF16)


@pytest.fixture(scope="module")
def l8b_none():
  return _compiled_with_hlo("llama3-8b", L8B + ["model.remat=none"])


def _state_and_batch_bytes(setup):
  t = setup.cfg.train
  return sum(memory.state_bytes(setup).values()) + 5 * 4 * t.batch_size * t.seq_len // 8  # batch split 8 ways


@needs_plugin
def test_tiny_and_llama_shaped_compile_for_8_h100s_with_arguments_equal_to_the_bill(tiny_packed, l8b_full):
  setup, c = tiny_packed
  assert c["backend"] == "cuda" and c["device_kind"] == "NVIDIA H100 80GB HBM3", c
  assert c["arguments"] == _state_and_batch_bytes(setup)
  setup, c, _ = l8b_full
  assert c["backend"] == "cuda"
  assert c["arguments"] == _state_and_batch_bytes(setup)


@needs_plugin
def test_full_remat_has_smaller_temporaries_than_none_on_the_gpu_compile(l8b_full, l8b_none):
  full, none = l8b_full[1]["temporaries"], l8b_none[1]["temporaries"]
  setup = l8b_none[0]
  rows = memory.grouped(memory.param_rows(setup))
  bills = {r: memory.bill(step_lib.Setup(config.load("llama3-8b", L8B + [f"model.remat={r}"]), setup.mesh), rows, 0.0)
           for r in ("none", "full")}
  billed = bills["none"].total - bills["full"].total  # cuDNN bill: no L x L matrix in either
  print(f"temporaries: remat none {none / 2**30:.2f} GiB, full {full / 2**30:.2f} GiB; billed saving "
        f"{billed / 2**30:.2f} GiB")
  assert 0.8 * billed < none - full < 1.25 * billed, (none, full, billed)


@needs_plugin
def test_cudnn_packed_segments_without_an_lxl_buffer_and_the_line_names_it(l8b_full, tiny_packed):
  setup, c, _ = l8b_full
  assert c["cudnn_attention"]["ops"] >= 2 and c["cudnn_attention"]["per_step"] >= 2 * 2  # fwd + bwd, 2 layers
  assert c["square_buffers"] == [], c["square_buffers"]
  # Negative control: the same shapes through the L x L mask path do hold L x L buffers.
  _, masked = _compiled("tiny", TINY_BF16[:-1])
  _, packed = tiny_packed
  assert masked["cudnn_attention"]["ops"] >= 2 and masked["square_buffers"], masked["square_buffers"]
  assert packed["cudnn_attention"]["ops"] >= 2 and packed["square_buffers"] == [], packed["square_buffers"]
  # inspect's text names the kernel and the count of custom calls it found
  # inspect's lines name the kernel chosen for the H100 and the calls the program holds
  assert packed["attention"]["kernel"] == masked["attention"]["kernel"] == "cudnn"
  text = "\n".join(report.render_compiled(packed))
  assert ("attention: cudnn (cuDNN fused attention (causal; segments as packed offsets, at most 8 per row "
          "(model.attention_max_segments)))") in text
  assert f"cuDNN fused attention: {packed['cudnn_attention']['ops']} custom call(s)" in text
  _, reference = _compiled("tiny", TINY_BF16 + ["model.attention=xla"])
  assert reference["attention"]["kernel"] == "xla" and reference["cudnn_attention"]["ops"] == 0


@needs_plugin
def test_fsdp_parameter_gathers_are_per_layer_inside_the_scanned_loop(l8b_full):
  setup, _, hlo = l8b_full
  layers = setup.cfg.model.n_layers
  d, f = setup.cfg.model.d_model, setup.cfg.model.d_ff
  in_loop, whole_model = [], []
  for i in hlo.instrs:
    if i.opcode not in ("all-gather", "all-gather-start"):
      continue
    dims = {tuple(int(x) for x in ds.split(",") if x) for _, ds in gpu_compile._ARRAY.findall(i.shape)}
    if hlo.times.get(i.computation, 1) == layers:  # runs once per layer: inside the scanned layer loop
      in_loop.append(dims)
    whole_model += [s for s in dims if s in ((layers, d, f), (layers, f, d))]
  assert any((d, f) in dims for dims in in_loop), in_loop  # one layer's w_gate/w_up, gathered in the loop
  assert whole_model == []  # never the stacked weights of all layers at once


@needs_plugin
def test_overlap_report_of_the_h100_compile_lists_collectives_times_them_and_counts_matmuls(l8b_full):
  """Every collective with its async flag, bytes (those of gpu_compile.collectives) and seconds; the
  layer loop's all-gathers; matmul FLOPs (cuDNN attention included) against a count from the shapes:
  full remat runs each layer's matmuls 4 times (forward, recomputed forward, 2 in the backward) but the
  recomputed w_down (its output is not needed backward), the attention forward twice and its backward
  (2.5 forwards) once, the LM head 3 times (the chunked loss computes no logits twice)."""
  from jaxtrain.analysis import overlap
  from jaxtrain.parallel import devices
  setup, c, hlo = l8b_full
  rep = overlap.report(hlo, devices.TABLE["H100"])
  for kind, v in rep["per_kind"].items():
    assert v["bytes"] == c["collectives"][kind]["bytes_per_step"], kind
  assert all(isinstance(r["async"], bool) and r["bytes"] > 0 and r["seconds"] > 0 for r in rep["collectives"])
  m, t = setup.cfg.model, setup.cfg.train
  loop = [lp for lp in rep["loops"] if lp["trip"] == m.n_layers]
  assert loop and all(lp["all_gathers"] == lp["async"] > 0 for lp in loop), rep["loops"]
  T = t.batch_size * t.seq_len // 8  # tokens per device
  hd = m.head_dim
  layer = 2 * T * (m.d_model * hd * (2 * m.n_heads + 2 * m.n_kv_heads) + 3 * m.d_model * m.d_ff)
  attention = 4 * T * t.seq_len * m.n_heads * hd
  want = m.n_layers * (4 * layer - 2 * T * m.d_ff * m.d_model + 4.5 * attention) + 3 * 2 * T * m.d_model * m.vocab_size
  tot = rep["totals"]
  assert abs(tot["matmul_flops"] - want) <= 1e-3 * want, (tot["matmul_flops"], want)
  assert tot["predicted_step_seconds"] == tot["compute_seconds"] + tot["exposed_seconds"]
  assert tot["compute_seconds"] >= want / devices.TABLE["H100"].peak_bf16_flops


@needs_plugin
def test_64_device_hybrid_mesh_of_8_hosts_compiles_tiny():
  setup, c = _compiled("tiny", ["train.batch_size=64"], spec="dp=8,fsdp=8,dcn.dp=8")
  assert setup.mesh.size == 64 and len({d.process_index for d in setup.mesh.devices.flat}) == 8
  # dcn.dp=8: the data axis crosses hosts, fsdp stays within one
  grid = setup.mesh.devices.reshape(8, 8)
  assert all(len({d.process_index for d in row}) == 1 for row in grid)
  assert c["backend"] == "cuda" and c["arguments"] == sum(memory.state_bytes(setup).values()) + 5 * 4 * 128
  assert c["collectives"]["all-gather"]["ops"] and c["collectives"]["all-reduce"]["ops"]


HIDE_PLUGIN = """
# As if no CUDA plugin were installed: its modules and jax's plugin entry points vanish.
import importlib.metadata as md, sys
for name in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins"):
  sys.modules[name] = None
real = md.entry_points
md.entry_points = lambda **kw: [] if kw.get("group") == "jax_plugins" else real(**kw)
from jaxtrain import inspect
sys.exit(inspect.main(sys.argv[1:]))
"""


def test_without_the_plugin_compile_falls_back_with_one_line(tmp_path):
  r = subprocess.run([sys.executable, "-c", HIDE_PLUGIN, "--device", "H100", "--compile", "--mesh", "fsdp=2", "--json"],
                     capture_output=True, text=True, cwd=tmp_path, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  # besides inspect's progress lines for the compile itself
  lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith(("compiling the train", "compiled in"))]
  assert len(lines) == 1 and "no CUDA plugin installed" in lines[0] and "XLA:CPU" in lines[0], r.stderr
  rep = json.loads(r.stdout)
  assert rep["compiled"]["backend"] == "cpu" and rep["compiled"]["compiler"] == "XLA:CPU"
  assert rep["memory"]["device_memory_source"] == "H100"


@needs_plugin
def test_llama31_8b_compiled_for_8_h100s_at_seq_8192_fits_in_80gib():
  """The real shapes and the preset's settings (32 scanned layers, seq 8192, save_dots),
  XLA:GPU compile-only; the bill agrees with it within 15%."""
  mesh = gpu_compile.mesh("H100", "host8")
  rep = report.report(config.load("llama3.1-8b"), mesh, "llama3.1-8b", compile=True, device_memory="H100")
  c = rep["compiled"]
  print(f"compiled total {c['total'] / 2**30:.2f} GiB in {c['seconds']:.1f}s; ratio {c['ratio_without_margin']:.3f}")
  assert c["backend"] == "cuda" and c["total"] <= 80 * 2**30 and rep["memory"]["fits"]
  assert c["arguments"] == c["analytic"]["arguments"]
  assert 0.85 <= c["ratio_without_margin"] <= 1.15
  assert c["cudnn_attention"]["ops"] >= 2  # fused attention, forward and backward


@needs_plugin
def test_dropless_mixtral_bill_on_the_moe_pod_within_10_percent_of_the_compile():
  """The dropless exchange's buffers (ep x bound rows per device and MoE layer) are on the bill: it agrees
  with XLA:GPU's compiled total within 10% (it read 1.27x low without them)."""
  mesh = gpu_compile.mesh("H100", "pod-8x8-moe")
  rep = report.report(config.load("mixtral-8x7b", ["model.moe_dropless=true"]), mesh, "mixtral-8x7b", compile=True,
                      device_memory="H100")
  c = rep["compiled"]
  print(f"compiled total {c['total'] / 2**30:.2f} GiB in {c['seconds']:.1f}s; ratio {c['ratio_without_margin']:.3f}")
  assert c["backend"] == "cuda" and 0.9 <= c["ratio_without_margin"] <= 1.1


@needs_plugin
@pytest.mark.parametrize("spec", ["sp=2", "pp=2"])
def test_mla_with_cudnn_compiles_under_ulysses_and_inside_a_pipeline(spec):
  """DeepSeek's latent attention (v narrower than q/k: zero-padded for cuDNN) on compile-only H100s where
  attention=auto picks cuDNN: under Ulysses (sequence=2) and inside the pipeline's region (pp=2). On main the
  padded path called the attention dispatch again from inside the kernel's own shard_map and could not trace.
  Rows of one document take cuDNN's causal path there too: no mask operand inside either region."""
  sets = ["model.n_layers=2", "model.moe_first_dense=0", "train.batch_size=4", "train.seq_len=128",
          "train.microbatches=2", "model.sequence_attention=ulysses", "model.scan_layers=true"]
  setup = step_lib.Setup(config.load("deepseek-v3-tiny", sets), gpu_compile.mesh("H100", spec), segments=1)
  assert setup.plan.attention == "cudnn" and setup.cfg.model.attention_type == "mla"
  compiled, _ = gpu_compile.compile_step(setup)
  calls = gpu_compile.cudnn_attention_calls(gpu_compile.Hlo.parse(compiled.as_text()))
  assert calls["per_step"] >= 2 * 2 and calls["mask_types"] == ["CAUSAL"] and calls["with_bias"] == 0, calls
