"""optim.in_backward: each layer's update inside the backward (jaxtrain.run.in_backward) against the plain step (the
gradient whole, then the optimizer): the same trajectory, the layers' gradient never held (compiled memory), and a
non-finite gradient in any one layer moving nothing in any layer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import data
from jaxtrain.analysis import gpu_compile, memory
from jaxtrain.core import config
from jaxtrain.core.errors import UserError
from jaxtrain.model import transformer as model_lib
from jaxtrain.run import step
from tests.helpers import mesh_of, needs_plugin

SMALL = ["model.dtype=float32", "model.scan_layers=true", "model.n_layers=3", "train.batch_size=8",
         "train.seq_len=32", "optim.warmup_steps=1"]


def _run(sets, spec: str, steps: int, state=None, batches=None):
  """(state after `steps` steps on mesh `spec`, [(loss, grad_norm, skipped)]), from `state` (the host's) or a fresh
  init; the run's own data unless `batches` (host batches) is given."""
  cfg = config.load("tiny", sets)
  setup = step.Setup(cfg, mesh_of(spec))
  it = data.batches(cfg) if batches is None else iter(batches)
  try:
    state = setup.init() if state is None else jax.device_put(state, setup.state_shardings)
    out = []
    for _ in range(steps):
      state, m = setup.step(state, setup.device_batch(next(it)))
      out.append((float(m["loss"]), float(m["grad_norm"]), bool(m["skipped"])))
  finally:
    if batches is None:
      it.close()
  return jax.device_get(state), out


def _close(got, want, rtol):
  """Every leaf within rtol of its reference, relative to the leaf's largest magnitude (moments near 0 included)."""
  def one(path, a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(np.max(np.abs(b)), 1e-30)
    assert np.max(np.abs(a - b)) <= rtol * scale, (jax.tree_util.keystr(path), np.max(np.abs(a - b)) / scale)
  jax.tree_util.tree_map_with_path(one, got, want)


@pytest.mark.slow
@pytest.mark.parametrize("spec,clip", [("data=1", "0"), ("fsdp=2,tensor=2", "0"), ("fsdp=2,tensor=2", "0.5")])
def test_the_update_in_the_backward_equals_the_plain_step(spec, clip):
  """4 float32 steps: losses, gradient norms, master weights, both moments and the step count within 1e-6 of the
  plain step on the same mesh. With clipping (the norm pass's global norm clips as the plain step's does) within
  1e-5: the two norms are sums in another order, and Adam's normalized update magnifies their last-bit difference
  in the clip factor on elements whose gradient is near zero (1.4e-6 of w_down's largest entry measured)."""
  sets = [*SMALL, f"optim.grad_clip={clip}", "model.tie_embeddings=true"]
  want, want_m = _run(sets, spec, 4)
  got, got_m = _run([*sets, "optim.in_backward=true"], spec, 4)
  assert not any(s for *_, s in got_m) and int(got["step"]) == 4
  rtol = 1e-6 if clip == "0" else 1e-5
  np.testing.assert_allclose(np.array(got_m)[:, :2], np.array(want_m)[:, :2], rtol=rtol)
  _close(got["params"], want["params"], rtol)
  _close(got["opt"], want["opt"], rtol)
  moved = jax.tree.map(lambda a, b: np.max(np.abs(np.asarray(a) - np.asarray(b))), got["params"],
                       _run(sets, "data=1", 0)[0]["params"])
  assert min(jax.tree.leaves(moved)) > 0  # every parameter moved: nothing compared with its own start


def _poison_layer(monkeypatch, marker: float):
  """Layers whose attention-norm scale[0] is `marker` get a NaN parameter gradient (their input's gradient and the
  loss stay finite): a non-finite gradient planted in chosen layers of the stack."""
  make = model_lib.layer_fn

  @jax.custom_vjp
  def poison(layer):
    return layer

  def fwd(layer):
    return layer, layer["attn_norm"]["scale"][0] == marker

  def bwd(hit, g):
    return (jax.tree.map(lambda t: jnp.where(hit, jnp.nan, t), g),)
  poison.defvjp(fwd, bwd)

  def layer_fn(*args, **kw):
    f = make(*args, **kw)
    return lambda x, layer: f(x, poison(layer))
  monkeypatch.setattr(model_lib, "layer_fn", layer_fn)


@pytest.mark.parametrize("layer", [2, 0])
def test_a_non_finite_gradient_in_one_layer_moves_no_parameter_of_any_layer(monkeypatch, layer):
  """A NaN gradient in the last layer (the first the backward meets) or in the first (the last it meets, after every
  other layer's gradient was seen) skips the step: every parameter, both moments, the schedule's counts and the
  applied-step count as before. The same marker in no layer (the control) applies the step."""
  _poison_layer(monkeypatch, 1.25)
  sets = [*SMALL, "optim.in_backward=true"]
  cfg = config.load("tiny", sets)
  batch = next(data.batches(cfg))
  start, _ = _run(sets, "data=1", 0)
  planted = jax.tree.map(np.array, start)
  planted["params"]["layers"]["attn_norm"]["scale"][layer, 0] = 1.25
  after, m = _run(sets, "data=1", 1, planted, [batch])
  assert m[0][2] and not np.isfinite(m[0][1]) and np.isfinite(m[0][0]), m  # skipped, NaN norm, finite loss
  jax.tree.map(np.testing.assert_array_equal, after["params"], planted["params"])
  jax.tree.map(np.testing.assert_array_equal, after["opt"], planted["opt"])
  assert int(after["step"]) == 0
  control = jax.tree.map(np.array, planted)
  control["params"]["layers"]["attn_norm"]["scale"][layer, 0] = 1.0
  after, m = _run(sets, "data=1", 1, control, [batch])
  assert not m[0][2] and int(after["step"]) == 1
  assert not np.array_equal(after["params"]["layers"]["mlp"]["w_up"], control["params"]["layers"]["mlp"]["w_up"])


def _temporaries(sets, mesh, billed=None) -> tuple[int, int, int]:
  """(plain step's temporaries, in-backward step's, the layers' gradient bytes per device) of compiled steps;
  `billed`: a list that gets each one's memory-bill gradient line."""
  out = []
  for on in ("false", "true"):
    setup = step.Setup(config.load("tiny", [*sets, f"optim.in_backward={on}"]), mesh)
    out.append(gpu_compile.CompiledMemory.of(gpu_compile.compile_step(setup)[0]).temporaries)
    if billed is not None:
      billed.append(memory.bill(setup, memory.param_rows(setup), 0.0).items["gradients"])
  layers = sum(x.size for x in jax.tree.leaves(setup.abstract_params["layers"]))
  return out[0], out[1], 4 * layers // mesh.size


BIG = ["model.scan_layers=true", "model.n_layers=8", "model.d_model=256", "model.d_ff=1024", "train.batch_size=2",
       "train.seq_len=32", "model.remat=full"]


@pytest.mark.slow
def test_the_compiled_step_holds_no_whole_gradient_on_the_cpu():
  """XLA:CPU's memory analysis, float32, 8 layers of 0.9 M parameters: the temporaries fall by at least the layers'
  gradient bytes (28.3 MB; measured 88.1 -> 23.7 MB: the plain step's update also copies state on this backend),
  and what is left could not hold that gradient; the memory bill's gradient line falls by 7/8 of it."""
  billed = []
  plain, fused, grad = _temporaries([*BIG, "model.dtype=float32"], mesh_of("data=1"), billed)
  assert plain - fused >= grad and fused < grad, (plain, fused, grad)
  # the bill: the stack's gradient one layer (of 8) at a time, the rest (embedding, head, final norm) whole
  assert billed[0] - billed[1] == grad * 7 // 8 and billed[0] - billed[1] <= plain - fused, billed


@needs_plugin
@pytest.mark.slow
def test_the_h100_compiled_step_holds_no_whole_gradient():
  """The H100-compiled step (deviceless), bfloat16 compute, fsdp=2: temporaries fall by most of the layers'
  gradient bytes per device (14.2 MB; measured 27.2 -> 16.9 MB: one moment stack is carried in a transposed layout
  XLA chose, a 4 MB copy here)."""
  plain, fused, grad = _temporaries([*BIG, "model.dtype=bfloat16"], gpu_compile.mesh("H100", "fsdp=2"))
  assert plain - fused >= 0.6 * grad, (plain, fused, grad)


@pytest.mark.parametrize("sets,words", [
    (["train.microbatches=2"], "train.microbatches=2"), (["model.scan_layers=false"], "model.scan_layers=false"),
    (["model.moe_experts=4", "model.moe_top_k=2"], "model.moe_experts=4"),
    (["model.lora_rank=4"], "model.lora_rank=4"), (["optim.name=muon"], "optim.name='muon'"),
    (["optim.zero_stage=1"], "optim.zero_stage=1"), (["optim.offload=host"], "optim.offload='host'"),
    (["optim.b1=0.99", "optim.b2=0.95"], "optim.b1**2 < optim.b2")])
def test_what_the_update_in_the_backward_does_not_run_is_one_line(sets, words):
  with pytest.raises(UserError) as e:
    config.load("tiny", ["model.scan_layers=true", "optim.in_backward=true", *sets])
  assert "\n" not in str(e.value) and words in str(e.value) and "optim.in_backward=true" in str(e.value)


def test_a_pipeline_is_refused_in_one_line():
  cfg = config.load("tiny", ["model.scan_layers=true", "optim.in_backward=true", "train.microbatches=1"])
  with pytest.raises(UserError, match=r"optim.in_backward=true with mesh pipeline=2 is not supported"):
    step.Setup(cfg, mesh_of("pipeline=2"))
