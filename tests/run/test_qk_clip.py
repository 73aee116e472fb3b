"""MuonClip's QK-clip (optim.qk_clip, jaxtrain/run/qk_clip.py) against a reference computed here: the q and k each
layer's attention receives (recorded from the model's own forward, eagerly), their logits, causal and per-segment
mask, maximum and Kimi K2's rescale in numpy, applied to the parameters of the same step without the clip; the
max-logit metric; mesh == one device; the one-line refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import data
from jaxtrain.core import config
from jaxtrain.core.errors import UserError
from jaxtrain.model import ops
from jaxtrain.run import step
from tests.helpers import mesh_of, trajectory

SMALL = ["model.dtype=float32", "model.d_model=32", "model.n_heads=4", "model.head_dim=8", "model.d_ff=64",
         "model.vocab_size=384", "train.batch_size=4", "train.seq_len=16", "train.steps=6", "optim.warmup_steps=1",
         "optim.lr=0.02", "model.init_std=0.5"]  # large weights: logits of several units


class _Recorder(ops.Ops):
  """The one-device reference, recording the (q, k) each attention call receives."""

  def __init__(self):
    self.seen = []

  def attend(self, q, k, v, seg, logits_dtype="float32", **kw):  # window=0, sinks_H=None: QK-clip refuses others
    self.seen.append((np.asarray(q, np.float64), np.asarray(k, np.float64), np.asarray(seg)))
    return super().attend(q, k, v, seg, logits_dtype, **kw)


def _max_logits(cfg, setup, params, batch) -> np.ndarray:
  """(n_layers, H): numpy's largest q.k / sqrt(E) per head over the causal, same-segment pairs of the batch."""
  rec = _Recorder()
  with jax.disable_jit(), ops.use(rec):  # eager: the scanned stack runs layer by layer in Python
    nnx.merge(setup.graphdef, params)(batch["inputs"], batch["positions"], batch["segment_ids"])
  return np.stack([_numpy_max_logit(q, k, seg) for q, k, seg in rec.seen])


def _one_step(cfg, spec="data=1"):
  setup = step.Setup(cfg, mesh_of(spec))
  it = data.batches(cfg)
  batch = next(it)
  it.close()
  state = setup.init()
  params0 = jax.device_get(state["params"])
  new, m = setup.step(state, setup.device_batch(batch))
  return setup, params0, batch, jax.device_get(new["params"]), jax.device_get(m)


def _attn(params, scanned: bool, n_layers: int):
  """[(wq, wk)] per layer, numpy."""
  if scanned:
    a = params["layers"]["attn"]
    return [(np.asarray(a["wq"][i]), np.asarray(a["wk"][i])) for i in range(n_layers)]
  return [(np.asarray(params["layers"][i]["attn"]["wq"]), np.asarray(params["layers"][i]["attn"]["wk"]))
          for i in range(n_layers)]


def _numpy_max_logit(q, k, seg) -> np.ndarray:
  """(H,): the largest q.k / sqrt(E) per head over the causal, same-segment pairs, float64."""
  B, L, H, E = q.shape
  k_BxLxHxE = np.repeat(k, H // k.shape[2], axis=2)  # query head h reads key head h // (H/K)
  s = np.einsum("blhe,bmhe->bhlm", q, k_BxLxHxE) / np.sqrt(E)
  allowed = np.tril(np.ones((L, L), bool))[None] & (seg[:, :, None] == seg[:, None, :])
  return np.where(allowed[:, None], s, -np.inf).max(axis=(0, 2, 3))


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_max_logit_and_the_rescale_of_given_weights_match_numpy(kv_heads):
  """Fast, no step: attention.max_logit on random q, k and two segments per row (the second segment's queries and
  the first's keys made large: a pair across segments would win if the mask let it) against numpy; qk_clip.clip on random
  stacked and unrolled weights against Kimi's factors; a step not applied clips nothing."""
  from jaxtrain.model import attention
  from jaxtrain.run import qk_clip
  rng = np.random.default_rng(0)
  q, k = rng.normal(size=(2, 8, 4, 8)), rng.normal(size=(2, 8, kv_heads, 8))
  q[:, 4:] *= 5.0
  k[:, :4] *= 5.0
  seg = np.array([[1] * 4 + [2] * 4, [1] * 6 + [2] * 2])
  got = attention.max_logit(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32), jnp.asarray(seg))
  np.testing.assert_allclose(got, _numpy_max_logit(q, k, seg), rtol=1e-5)
  max_LxH = np.array([[3.0, 9.0, 0.5, 4.5], [12.0, 1.0, 4.0, 6.0]], np.float32)
  tau = 4.0
  gamma = np.where(max_LxH > tau, tau / max_LxH, 1.0)
  q_f, k_f = (np.sqrt(gamma), np.sqrt(gamma)) if kv_heads == 4 else (gamma, np.ones((2, kv_heads)))
  for scan in (False, True):
    cfg = config.load("tiny", [*SMALL, f"model.n_kv_heads={kv_heads}", f"model.scan_layers={str(scan).lower()}",
                               f"optim.qk_clip={tau}"])
    wq, wk = rng.normal(size=(2, 32, 4, 8)), rng.normal(size=(2, 32, kv_heads, 8))
    if scan:
      params = {"layers": {"attn": {"wq": jnp.asarray(wq), "wk": jnp.asarray(wk), "wv": jnp.ones(3)}}}
      at = lambda p, i, name: np.asarray(p["layers"]["attn"][name][i])  # noqa: E731
    else:
      params = {"layers": {i: {"attn": {"wq": jnp.asarray(wq[i]), "wk": jnp.asarray(wk[i]), "wv": jnp.ones(3)}}
                           for i in range(2)}}
      at = lambda p, i, name: np.asarray(p["layers"][i]["attn"][name])  # noqa: E731
    clipped = qk_clip.clip(cfg, params, jnp.asarray(max_LxH), jnp.bool_(True))
    kept = qk_clip.clip(cfg, params, jnp.asarray(max_LxH), jnp.bool_(False))
    for i in range(2):
      np.testing.assert_allclose(at(clipped, i, "wq"), wq[i] * q_f[i][None, :, None], rtol=1e-6)
      np.testing.assert_allclose(at(clipped, i, "wk"), wk[i] * k_f[i][None, :, None], rtol=1e-6)
      np.testing.assert_array_equal(at(kept, i, "wq"), at(params, i, "wq"))
      np.testing.assert_array_equal(at(kept, i, "wk"), at(params, i, "wk"))
      np.testing.assert_array_equal(at(clipped, i, "wv"), at(params, i, "wv"))


@pytest.mark.slow  # two compiled steps each
@pytest.mark.parametrize("sets", [
    ["model.n_kv_heads=4", "optim.name=muon"],  # a key head per query head: sqrt(gamma) on each
    ["model.n_kv_heads=2", "model.scan_layers=true", "train.microbatches=2"],  # grouped keys stay; AdamW
], ids=["mha-muon", "gqa-scan-adamw"])
def test_qk_clip_rescales_the_heads_over_tau_as_numpy_does(sets):
  plain = config.load("tiny", [*SMALL, *sets])
  setup, params0, batch, unclipped, _ = _one_step(plain)
  max_LxH = _max_logits(plain, setup, params0, batch)
  tau = float(np.median(max_LxH))  # some heads over it, some not
  cfg = config.load("tiny", [*SMALL, *sets, f"optim.qk_clip={tau!r}"])
  _, _, _, clipped, m = _one_step(cfg)
  np.testing.assert_allclose(m["attn_max_logit"], max_LxH.max(axis=1), rtol=1e-5)
  assert int(m["qk_clipped_heads"]) == int((max_LxH > tau).sum()) > 0
  gamma_LxH = np.where(max_LxH > tau, tau / max_LxH, 1.0)
  H, K = cfg.model.n_heads, cfg.model.n_kv_heads
  scanned, n = cfg.model.scan_layers, cfg.model.n_layers
  for i, ((wq, wk), (cq, ck)) in enumerate(zip(_attn(unclipped, scanned, n), _attn(clipped, scanned, n))):
    q_f, k_f = (np.sqrt(gamma_LxH[i]), np.sqrt(gamma_LxH[i])) if K == H else (gamma_LxH[i], np.ones(K))
    np.testing.assert_allclose(cq, wq * q_f[None, :, None], rtol=1e-5, atol=1e-7, err_msg=f"wq of layer {i}")
    np.testing.assert_allclose(ck, wk * k_f[None, :, None], rtol=1e-5, atol=1e-7, err_msg=f"wk of layer {i}")
  is_qk = lambda path: str(getattr(path[-1], "key", "")) in ("wq", "wk")  # noqa: E731
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(unclipped), jax.tree.leaves(clipped), strict=True):
    if not is_qk(path):
      np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow  # compiles of whole steps on a mesh
def test_qk_clip_on_a_mesh_equals_one_device():
  """Heads split over tensor, d_model over fsdp, a scanned stack: 3 steps that clip, loss and grad norm (the
  clipped weights' effect from step 2 on) and the clipped-head count as on one device, float32 1e-5."""
  cfg = config.load("tiny", [*SMALL[:-1], "model.n_kv_heads=2", "model.scan_layers=true", "optim.name=muon",
                             "optim.qk_clip=0.03"])
  keys = ("loss", "grad_norm", "qk_clipped_heads")
  ref, got = trajectory(cfg, "data=1", 3, keys), trajectory(cfg, "fsdp=2,tensor=2", 3, keys)
  assert ref[:, 2].min() > 0
  np.testing.assert_allclose(got, ref, rtol=1e-5)


@pytest.mark.parametrize("sets,words", [
    (["model.attention_type=mla"], "model.attention_type='mla'"),
    (["model.qk_norm=true"], "model.qk_norm=true"),
    (["model.lora_rank=4"], "model.lora_rank=4"),
    (["optim.offload=host"], "optim.offload='host'"),
    (["model.mtp_layers=1"], "model.mtp_layers=1"),
])
def test_qk_clip_combinations_it_has_no_rule_for_are_refused_in_one_line(sets, words):
  with pytest.raises(UserError) as e:
    config.load("tiny", [*sets, "optim.qk_clip=50"])
  line = str(e.value)
  assert "\n" not in line and "optim.qk_clip=50" in line and words in line, line


def test_qk_clip_on_a_pipeline_is_refused_in_one_line():
  with pytest.raises(UserError) as e:
    step.Setup(config.load("tiny", [*SMALL, "optim.qk_clip=50", "model.n_layers=2", "train.microbatches=2"]),
               mesh_of("pipeline=2"))
  assert "\n" not in str(e.value) and "optim.qk_clip=50" in str(e.value) and "pipeline=2" in str(e.value)
