"""QLoRA (model.lora_base_dtype): LoRA's frozen base stored quantized (nf4, int8) in the train state and dequantized
where the compute copy is made. Checked against the numpy format references of tests/model/test_quant.py, against
the bf16 LoRA model's logits, the real state's bytes, a training run with an exact resume, and a 2-device mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import data
from jaxtrain.core import config
from jaxtrain.core.errors import UserError
from jaxtrain.model import quant, roles, transformer as model_lib
from jaxtrain.interop import hf_export
from jaxtrain.run import checkpoint, runs, step
from jaxtrain.analysis import comms, gpu_compile, memory, overlap
from tests.helpers import mesh_of, trajectory
from tests.model.test_quant import PUBLISHED_NF4, _ref_int8, _ref_nf4

LORA = ["model.lora_rank=4", "model.lora_alpha=8", "model.lora_targets=q,k,v,o,gate,up,down", "optim.lr=3e-2",
        "train.batch_size=4", "train.seq_len=32"]


def _cfg(fmt, *sets):
  return config.load("tiny", [*LORA, f"model.lora_base_dtype={fmt}", *sets])


def _base(cfg):
  """The float32 parameters init_state starts from (the seed's; under jit as Setup.init makes them)."""
  return jax.jit(lambda: nnx.to_pure_dict(nnx.state(model_lib.Transformer(cfg.model, nnx.Rngs(cfg.train.seed)))))()


def _ref_dequant(w, fmt, in_axis):
  """The format's reference dequantization, from the reference codes and scales (numpy)."""
  if fmt == "int8":
    codes, scale = _ref_int8(w, in_axis)
    return codes.astype(np.float32) * np.expand_dims(scale, in_axis)
  codes, scales = _ref_nf4(w, in_axis)
  idx = np.stack([codes >> 4, codes & 0xF], axis=-1).reshape(-1)[:w.size]
  vals = PUBLISHED_NF4.astype(np.float32)[idx] * np.repeat(scales, 64)[:w.size]
  moved = np.moveaxis(w, in_axis, -1).shape
  return np.moveaxis(vals.reshape(moved), -1, in_axis)


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_stored_base_dequantizes_to_the_format_reference(fmt):
  """Every decoder projection in the state is a QTensor whose dequantization is quant.dequantize of the float32
  base exactly, and the numpy reference of the format exactly; embedding and head stay plain bf16 arrays."""
  cfg = _cfg(fmt)
  state = step.Setup(cfg, mesh_of("fsdp=1")).init()
  base = _base(cfg)
  flat = dict(jax.tree_util.tree_leaves_with_path(state["params"], is_leaf=quant.is_quantized))
  n = 0
  for path, w in jax.tree_util.tree_leaves_with_path(base):
    got, role = flat[path], roles.of(cfg.model, path)
    if role.quant == "none":
      assert not quant.is_quantized(got) and got.dtype == (jnp.bfloat16 if role.low_master else jnp.float32), path
      continue
    n += 1
    assert quant.is_quantized(got) and got.fmt == fmt, path
    deq = np.asarray(quant.dequantize(got, jnp.float32))
    np.testing.assert_array_equal(deq, np.asarray(quant.dequantize(quant.quantize(w, fmt, role.in_axis), jnp.float32)))
    np.testing.assert_array_equal(deq, _ref_dequant(np.asarray(w), fmt, role.in_axis), err_msg=str(path))
  assert n == 7 * cfg.model.n_layers  # q, k, v, o, gate, up, down in every layer


# (max |d| / max |want|, rms(d) / rms(want)) for d = QLoRA logits - bf16 LoRA logits at step 0 on tiny (seed 0,
# 2x32 tokens), measured: nf4 (0.174, 0.159), int8 (0.0150, 0.0130). A random init's tiny d_model=128 weights are
# all noise, the worst case for 4 bits; the bounds leave about 1.7x margin.
TOLERANCE = {"nf4": (0.3, 0.27), "int8": (0.026, 0.022)}


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_logits_within_tolerance_of_the_bf16_base(fmt):
  """The QLoRA model's step-0 logits (the base dequantized to bf16) against the bf16 LoRA model's: within
  TOLERANCE (max and rms error relative to the logits' max and rms), and not equal (the base is quantized)."""
  cfg, lora = _cfg(fmt), config.load("tiny", LORA)
  graphdef = nnx.graphdef(model_lib.Transformer(cfg.model, nnx.Rngs(0)))
  base = _base(cfg)
  tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 32))
  pos, seg = np.broadcast_to(np.arange(32), (2, 32)), np.ones((2, 32), np.int32)
  want = np.asarray(nnx.merge(graphdef, roles.stored(lora.model, base))(tokens, pos, seg), np.float32)
  q = quant.dequantized(roles.stored(cfg.model, base), cfg.model.dtype)
  got = np.asarray(nnx.merge(graphdef, q)(tokens, pos, seg), np.float32)
  d = got - want
  rel = (np.max(np.abs(d)) / np.max(np.abs(want)), np.sqrt(np.mean(d ** 2) / np.mean(want ** 2)))
  assert 0 < rel[0] < TOLERANCE[fmt][0] and 0 < rel[1] < TOLERANCE[fmt][1], rel


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_bill_counts_the_quantized_bytes(fmt):
  """The bill's stored params = quant.nbytes of each quantized weight + the rest at their dtype = the real state's
  arrays' bytes; its dequantized_base = those weights in the compute dtype."""
  cfg = _cfg(fmt)
  setup = step.Setup(cfg, mesh_of("fsdp=1"))
  state = setup.init()
  actual = sum(x.nbytes for x in jax.tree.leaves(state["params"]))
  by_hand = 0
  for path, w in jax.tree_util.tree_leaves_with_path(_base(cfg)):
    role = roles.of(cfg.model, path)
    by_hand += (quant.nbytes(w.shape, fmt, role.in_axis) if role.quant != "none" else
                w.size * (2 if role.low_master else 4))
  assert memory.state_bytes(setup)["params"] == actual == by_hand
  assert sum(r.bytes for r in memory.param_rows(setup, stored=True)) == actual
  lora_state = step.Setup(config.load("tiny", LORA), mesh_of("fsdp=1")).init()
  lora = sum(x.nbytes for x in jax.tree.leaves(lora_state["params"]))
  assert actual < lora
  # one layer's dequantized projections (the model dequantizes where a layer runs): billed in the compute dtype
  bill = memory.bill(setup, memory.grouped(memory.param_rows(setup)), 0.1)
  layer0 = _base(cfg)["layers"][0]
  deq = sum(w.size * np.dtype(cfg.model.dtype).itemsize for path, w in jax.tree_util.tree_leaves_with_path(layer0)
            if roles.of(cfg.model, ("layers", 0, *roles.keys_of(path))).quant != "none")
  assert bill.items["dequantized_base"] == deq > 0


def test_trains_and_resumes_exactly(tmp_path):
  """nf4: the loss falls over 4 steps, the base never changes, and a state saved at step 2 and restored gives the
  same steps 3 and 4 bit for bit."""
  cfg = _cfg("nf4")
  setup = step.Setup(cfg, mesh_of("fsdp=1"))
  it = data.batches(cfg)
  batches = [setup.device_batch(next(it)) for _ in range(4)]
  it.close()
  state = setup.init()
  codes0 = np.asarray(state["params"]["layers"][0]["mlp"]["w_up"].codes)
  losses = []
  for i, b in enumerate(batches):
    if i == 2:
      ck = checkpoint.Checkpoints(tmp_path, 3, 0, False)
      ck.save(2, state, {})
      ck.close()
    state, m = setup.step(state, b)
    losses.append(float(m["loss"]))
  assert losses[-1] < losses[0]
  np.testing.assert_array_equal(np.asarray(state["params"]["layers"][0]["mlp"]["w_up"].codes), codes0)
  ck = checkpoint.Checkpoints(tmp_path, 3, 0, False)
  restored, _ = ck.restore(tmp_path / "2", setup.abstract_state())
  assert quant.is_quantized(restored["params"]["layers"][0]["mlp"]["w_up"])
  for b in batches[2:]:
    restored, m = setup.step(restored, b)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_merged_export_is_the_dequantized_base_plus_the_adapters(tmp_path):
  """What export reads (runs.restore_params) is the base dequantized to float32; the merged weight adds A B alpha/r."""
  cfg = _cfg("int8")
  setup = step.Setup(cfg, mesh_of("fsdp=1"))
  state = setup.init()
  attn = state["params"]["layers"][1]["attn"]
  attn["wo_lora"]["lora_b"] = attn["wo_lora"]["lora_b"] + 0.5  # B nonzero: the delta shows
  ck = checkpoint.Checkpoints(tmp_path, 3, 0, False)
  ck.save(0, state, {"config": cfg.to_dict()})
  ck.close()
  _, params = runs.restore_params(cfg, mesh_of("fsdp=1"), tmp_path / "0")
  merged = hf_export._merged(cfg, params)["layers"][1]["attn"]["wo"]
  a, b = (np.asarray(attn["wo_lora"][k], np.float64) for k in ("lora_a", "lora_b"))
  want = (np.asarray(quant.dequantize(attn["wo"], jnp.float32), np.float64)
          + np.tensordot(a, b, 1) * cfg.model.lora_alpha / cfg.model.lora_rank)
  np.testing.assert_allclose(np.asarray(merged), want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # 17 s and 10 s
@pytest.mark.parametrize("spec", ["fsdp=2", "tp=2"])
def test_two_devices_match_one(spec):
  """float32 compute over an nf4 base: loss and grad_norm on 2 devices within 1e-5 of one device."""
  cfg = _cfg("nf4", "model.dtype=float32")
  got, want = trajectory(cfg, spec, 2), trajectory(cfg, "dp=1", 2)
  np.testing.assert_allclose(got, want, rtol=1e-5)


MOE = ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_first_dense=1", "model.n_layers=3"]


@pytest.mark.slow  # a MoE state initialized twice
@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_experts_are_quantized_one_expert_at_a_time(fmt):
  """MoE (scanned, after a dense first layer): each expert's (in, out) matrix of each layer is quantized alone, as
  bitsandbytes quantizes one nn.Linear: its dequantization equals the format's numpy reference of that matrix."""
  cfg = _cfg(fmt, *MOE, "model.scan_layers=true", "model.lora_targets=q,gate")
  state = step.Setup(cfg, mesh_of("fsdp=1")).init()
  base = _base(cfg)
  for name in ("w_gate", "w_down"):
    got = state["params"]["layers"]["mlp"][name]
    w = np.asarray(base["layers"]["mlp"][name])  # (layers, experts, in, out)
    assert quant.is_quantized(got) and got.shape == w.shape[2:] and got.in_axis == 0
    deq = np.asarray(quant.dequantize(got, jnp.float32))
    for layer, expert in np.ndindex(*w.shape[:2]):
      np.testing.assert_array_equal(deq[layer, expert], _ref_dequant(w[layer, expert], fmt, 0))
  dense = state["params"]["dense_layers"]["mlp"]["w_up"]  # the dense first layer: one matrix per layer
  np.testing.assert_array_equal(np.asarray(quant.dequantize(dense, jnp.float32))[0],
                                _ref_dequant(np.asarray(base["dense_layers"]["mlp"]["w_up"])[0], fmt, 0))


@pytest.mark.slow  # compiles of whole steps
@pytest.mark.parametrize("sets", [[], MOE], ids=["dense", "moe"])
def test_scanned_layers_equal_unscanned(sets):
  """The scan dequantizes a layer's slice of the stacked codes where it runs: float32 compute, 2 steps of a
  scanned stack equal the unscanned layers (same codes: each matrix quantized alone) within 1e-5."""
  cfg = lambda scan: _cfg("nf4", *sets, "model.dtype=float32", f"model.scan_layers={scan}")  # noqa: E731
  np.testing.assert_allclose(trajectory(cfg("true"), "dp=1", 2), trajectory(cfg("false"), "dp=1", 2), rtol=1e-5)


@pytest.mark.slow  # compiles of whole steps
def test_moe_expert_mesh_matches_one_device():
  """nf4 experts split over `expert` (codes and scales with them): loss and grad_norm within 1e-5 of one device."""
  cfg = _cfg("nf4", *MOE, "model.dtype=float32", "model.scan_layers=true")
  np.testing.assert_allclose(trajectory(cfg, "expert=2", 2), trajectory(cfg, "dp=1", 2), rtol=1e-5)


def _compiled_bytes(cfg):
  """(argument, temporary) bytes of XLA's compiled train step on one CPU device."""
  setup = step.Setup(cfg, mesh_of("fsdp=1"))
  ma = setup.step.lower(*gpu_compile.abstract_inputs(setup)).compile().memory_analysis()
  return ma.argument_size_in_bytes, ma.temp_size_in_bytes


@pytest.mark.slow  # compiles of whole steps
@pytest.mark.parametrize("remat", ["full", "none"])
def test_peak_memory_is_below_loras(remat):
  """The compiled step (6 scanned layers whose weights dwarf the activations): QLoRA's arguments are smaller (the
  codes) and so are its temporaries, because no whole dequantized copy of the base exists: a layer's weights are
  dequantized where it runs and made again in backward (remat none: every matmul's output is kept instead of
  them). Measured: full 138 -> 30 MB, none 178 -> 48 MB (arguments + temporaries)."""
  sets = ["model.d_model=512", "model.n_layers=6", "model.d_ff=2048", "model.n_heads=8", "model.n_kv_heads=8",
          "model.scan_layers=true", "train.batch_size=2", "train.seq_len=64", f"model.remat={remat}"]
  lora_args, lora_temp = _compiled_bytes(config.load("tiny", [*LORA, *sets]))
  q_args, q_temp = _compiled_bytes(_cfg("nf4", *sets))
  assert q_args < lora_args and q_temp < lora_temp, (q_args, q_temp, lora_args, lora_temp)


def test_refusals():
  with pytest.raises(UserError, match="lora_base_dtype"):
    config.load("tiny", ["model.lora_base_dtype=nf4"])
  with pytest.raises(UserError):
    config.load("tiny", [*LORA, "model.lora_base_dtype=fp4"])


@pytest.mark.slow  # compiles of whole steps
def test_fsdp_gathers_the_codes_not_the_dequantized_weights():
  """fsdp=8: the plan gathers a layer's codes and scales before dequantizing them (plan.dequantize), so the
  compiled step's all-gathers carry about a quarter of the bf16 LoRA step's (measured 4.2 vs 13.0 MB; before, XLA
  gathered the float32 values after the lookup: 23.8 MB), and comms bills the codes' bytes."""
  def gathered(*sets):
    cfg = config.load("tiny", ["model.d_model=512", "model.d_ff=1024", "model.lora_rank=4", "train.batch_size=8",
                               "train.seq_len=32", *sets])
    setup = step.Setup(cfg, mesh_of("fsdp=8"))
    text = setup.step.lower(*gpu_compile.abstract_inputs(setup)).compile().as_text()
    billed = comms.traffic(setup.cfg, setup.mesh, memory.grouped(memory.param_rows(setup)))["fsdp"]
    return overlap.report(gpu_compile.Hlo.parse(text))["per_kind"]["all-gather"]["wire_bytes"], billed
  lora, lora_bill = gathered()
  nf4, nf4_bill = gathered("model.lora_base_dtype=nf4")
  assert nf4 < lora / 2, (nf4, lora)
  key = "param all-gather (fwd+bwd)"
  assert nf4_bill[key] < lora_bill[key] / 2


@pytest.mark.parametrize("allowed", [set(), {"model"}])
def test_a_quantized_base_onto_a_lora_checkpoint_names_the_option(tmp_path, allowed):
  """Resuming a LoRA checkpoint with model.lora_base_dtype=nf4 (with or without --allow-mismatch model) is one line
  naming the option and the checkpoint's and the run's values, not only a parameter absent here."""
  from jaxtrain.run import loop
  lora, nf4 = config.load("tiny", LORA), _cfg("nf4")
  mesh = mesh_of("fsdp=1")
  ck = checkpoint.Checkpoints(tmp_path, 3, 0, False)
  ck.save(2, step.Setup(lora, mesh).init(), {"fingerprint": checkpoint.fingerprint(lora, "tok", "data")})
  ck.close()
  accept = loop._same_run(checkpoint.fingerprint(nf4, "tok", "data"), allowed, step.Setup(nf4, mesh))
  with pytest.raises(UserError) as e:
    accept(tmp_path / "2", checkpoint.read_manifest(tmp_path / "2"))
  line = str(e.value)  # (an --allow-mismatch model suggested here would only meet a parameter absent)
  assert "model.lora_base_dtype: 'none' -> 'nf4'" in line and "the checkpoint's -> this run's" in line
  assert "layers/0/attn/wk" in line and "to resume anyway" not in line
