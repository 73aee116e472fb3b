"""What the H100-compiled train step runs, without a GPU (issue: the fastest step on a real GPU): which cuDNN
attention path the data's rows get, and the optimizer update as one pass over p, g, m, v. Byte counts cannot see
which kernel runs; the optimized HLO's custom calls and fusions can."""

import collections
import math
import re

import pytest

from jaxtrain.analysis import gpu_compile, report
from jaxtrain.core import config
from jaxtrain.run import step as step_lib
from tests.helpers import needs_plugin

pytestmark = pytest.mark.slow  # whole-step compiles for the GPU target

TINY = ["model.dtype=bfloat16", "train.seq_len=96", "train.batch_size=8", "model.n_layers=2"]


def _hlo(sets, spec="fsdp=2", segments=None):
  setup = step_lib.Setup(config.load("tiny", sets), gpu_compile.mesh("H100", spec), segments=segments)
  compiled, _ = gpu_compile.compile_step(setup)
  return setup, gpu_compile.Hlo.parse(compiled.as_text())


@pytest.fixture(scope="module")
def one_document():
  return _hlo(TINY, segments=1)


@needs_plugin
def test_one_document_rows_call_cudnn_causal_alone_and_packed_rows_pass_offsets(one_document):
  setup, hlo = one_document
  calls = gpu_compile.cudnn_attention_calls(hlo)
  assert setup.plan.packed_segments == 1 and "causal alone, no mask" in setup.plan.describe()
  assert calls["ops"] >= 4 and calls["mask_types"] == ["CAUSAL"] and calls["with_bias"] == 0, calls
  fmha = [i for i in hlo.instrs if i.opcode == "custom-call" and "__cudnn$fmha" in i.rest]
  assert {len(gpu_compile.operands(i)) for i in fmha if "Backward" not in i.rest} == {3}  # q, k, v: no mask operand
  _, packed = _hlo(TINY, segments=5)
  calls = gpu_compile.cudnn_attention_calls(packed)
  assert calls["mask_types"] == ["PADDING_CAUSAL"] and calls["with_bias"] == 0, calls
  fwd = [i for i in packed.instrs if i.opcode == "custom-call" and 'custom_call_target="__cudnn$fmhaSoftmax"' in i.rest]
  assert fwd and all(re.search(r"f32\[20,", i.shape) for i in fwd)  # statistics: 4 rows a device x 5 slots
  # negative control: rows whose documents are not known to the plan go as an L x L mask (a bias operand)
  _, masked = _hlo(TINY)
  calls = gpu_compile.cudnn_attention_calls(masked)
  assert calls["with_bias"] == calls["ops"] >= 4, calls
  assert "(mask types CAUSAL; 0 with a bias operand)" in "\n".join(
      report.render_compiled({"cudnn_attention": gpu_compile.cudnn_attention_calls(hlo)}))


def _logits_writers(hlo, tokens: int, vocab: int) -> tuple[list[str], list[str]]:
  """(the step's kernels that write float32 arrays of `tokens` x `vocab` logits, the scatters among all ops)."""
  callees = (re.search(r"calls=%?([\w.\-]+)", i.rest) for i in hlo.instrs if i.opcode == "fusion")
  fused = {m.group(1) for m in callees if m}  # fusion bodies: their ops are not kernels

  def logits(shape):
    return any(dt == "f32" and dims.split(",")[-1] == str(vocab)
               and math.prod(map(int, dims.split(","))) == tokens * vocab
               for dt, dims in re.findall(r"(\w+)\[([0-9,]+)\]", shape))
  kernels = [i.name for i in hlo.instrs if i.computation not in fused and i.opcode in ("fusion", "custom-call")
             and logits(i.shape)]
  return kernels, [i.name for i in hlo.instrs if i.opcode == "scatter" and logits(i.shape)]


@needs_plugin
def test_the_h100_step_takes_one_chunk_where_the_logits_fit_and_passes_over_them_less_than_the_plain_loss(
    one_document):
  """tiny's 768 tokens of 512-entry logits on one H100 are far within 1/32 of it: the automatic loss is one chunk of
  all 768 (on fsdp=2, 384 a device). Its program writes the float32 logits in fewer kernels than the plain loss's,
  whose autodiff scatters the label term into zeros and multiplies (two more passes), and scatters nothing."""
  assert one_document[0].plan.loss_chunk_tokens == 384
  auto, plain = (_hlo([*TINY, *sets], "fsdp=1", segments=1) for sets in ([], ["train.loss_chunk_tokens=0"]))
  assert auto[0].cfg.train.loss_chunk_tokens == -1 and auto[0].plan.loss_chunk_tokens == 768
  (auto_kernels, auto_scatters), (plain_kernels, plain_scatters) = (_logits_writers(h, 768, 512)
                                                                    for h in (auto[1], plain[1]))
  assert plain_scatters and not auto_scatters, (plain_scatters, auto_scatters)
  assert len(auto_kernels) < len(plain_kernels), (auto_kernels, plain_kernels)


def _readers_of_moments(hlo) -> collections.Counter:
  """For each Adam moment array of the state (an entry parameter), the ops that read it."""
  moments = {i.name for i in hlo.instrs if i.opcode == "parameter" and i.shape.startswith("f32")
             and re.search(r"op_name=\"state\[\\'opt\\'\]\[0\]\.(mu|nu)", i.rest)}
  readers = collections.Counter()
  for i in hlo.instrs:
    for o in gpu_compile.operands(i):
      if o.lstrip("%") in moments:
        readers[o.lstrip("%"), i.opcode] += 1
  return moments, readers


@needs_plugin
def test_the_optimizer_update_is_one_fusion_per_parameter_over_p_g_m_v(one_document):
  """Each moment is read by one fusion, which writes the new parameter and both moments: the guard's decision is
  known before the update (`optimizer.stays_finite`), so nothing picks new or old values in a second pass (the
  old guard: a fusion checking the new parameters, then another choosing, each reading m and v)."""
  setup, hlo = one_document
  moments, readers = _readers_of_moments(hlo)
  assert len(moments) == 2 * 21, len(moments)  # mu and nu of the tiny model's 21 arrays (2 layers)
  assert all(readers[m, "fusion"] == 1 for m in moments), readers
  assert sum(readers.values()) == len(moments)  # and no other op reads them
  update = {i.name: i for i in hlo.instrs if i.opcode == "fusion"
            and any(o.lstrip("%") in moments for o in gpu_compile.operands(i))}
  assert all(re.match(r"\(f32\[[\d,]*\]\S*, f32\[", i.shape) for i in update.values())  # p, m, v out, together


@needs_plugin
@pytest.mark.parametrize("segments", [1, 5])
def test_cudnn_calls_carry_the_local_layers_window(segments):
  """Alternate local/global layers (a scanned stack switching kernels per layer): the H100 step's cuDNN calls carry
  the window on the local layers' branch and none on the global ones', forward and backward, whole rows and
  packed."""
  sets = [*TINY, "model.sliding_window=24", "model.layer_types=alternate", "model.scan_layers=true"]
  _, hlo = _hlo(sets, segments=segments)
  fmha = [i.rest for i in hlo.instrs if i.opcode == "custom-call" and "__cudnn$fmha" in i.rest]
  windows = collections.Counter(re.search(r'"sliding_window_length":\s*"?(\d+)', r).group(1) for r in fmha)
  assert set(windows) == {"0", "24"} and windows["24"] >= 2, windows  # forward and backward of each kind


def _fmha_kinds(hlo) -> collections.Counter:
  """(fwd | bwd, mask type, with a bias operand) of each cuDNN attention call."""
  targets = ((re.search(r'custom_call_target="([^"]+)"', i.rest)[1], i) for i in hlo.instrs
             if i.opcode == "custom-call" and "__cudnn$fmha" in i.rest)
  return collections.Counter(("bwd" if "Backward" in t else "fwd", re.search(r'"mask_type":\s*"(\w+)"', i.rest)[1],
                              "Bias" in t) for t, i in targets)


@needs_plugin
def test_ring_attention_calls_cudnn_on_each_block_pair():
  """sequence=4, zig-zag: per layer the diagonal pair (CAUSAL) and both branches of each of the 3 ring steps'
  pairs (NO_MASK, wholly visible), forward and backward; rows of one document without a mask operand, packed rows
  with each pair's segment mask as a bias; MLA too; model.attention=xla keeps the online softmax (no cuDNN
  call)."""
  layers, off = 2, 2 * 3 * 2
  for segments, bias in ((1, False), (5, True)):
    setup, hlo = _hlo(TINY, "sequence=4", segments=segments)
    assert setup.plan.ring_kernel == "cudnn" and "cuDNN fused attention on each block pair" in setup.plan.describe()
    assert _fmha_kinds(hlo) == {("fwd", "CAUSAL", bias): layers, ("bwd", "CAUSAL", bias): layers,
                                ("fwd", "NO_MASK", bias): off, ("bwd", "NO_MASK", bias): off}, _fmha_kinds(hlo)
    assert gpu_compile.cudnn_attention_calls(hlo)["with_bias"] == (2 * layers + 2 * off) * bias
  mla = ["model.attention_type=mla", "model.q_lora_rank=16", "model.kv_lora_rank=16", "model.qk_nope_head_dim=16",
         "model.qk_rope_head_dim=16", "model.v_head_dim=16"]  # v narrower than q and k: zero-padded
  setup, hlo = _hlo([*TINY, *mla], "sequence=4", segments=1)
  assert setup.plan.ring_kernel == "cudnn" and sum(_fmha_kinds(hlo).values()) == 2 * layers + 2 * off
  setup, hlo = _hlo([*TINY, "model.attention=xla"], "sequence=4", segments=1)
  assert setup.plan.ring_kernel == "flash" and not _fmha_kinds(hlo)
