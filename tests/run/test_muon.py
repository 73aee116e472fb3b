"""Muon (optim.name=muon, jaxtrain/run/muon.py) against optax.contrib.muon, an independent implementation configured
the same way: the train step's parameters after several steps on one device in float32, which parameters get Muon,
the bound the guarded update relies on, and the one-line refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from optax.contrib import _muon as contrib

from jaxtrain import data
from jaxtrain.core import config
from jaxtrain.core.errors import UserError
from jaxtrain.model import roles, transformer as model_lib
from jaxtrain.run import muon as muon_lib, optimizer as optim_lib
from tests.helpers import grads_of, mesh_of

SMALL = ["model.dtype=float32", "model.d_model=32", "model.n_heads=4", "model.head_dim=8", "model.d_ff=64",
         "model.vocab_size=384", "train.batch_size=4", "train.seq_len=16", "train.steps=6", "optim.warmup_steps=2",
         "optim.name=muon", "optim.lr=0.02", "optim.weight_decay=0.1", "optim.grad_clip=0.5"]
PROJECTIONS = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}  # by name: the matrices Muon must take
STEPS = 4


def _dims(path, x, stacked: bool, experts: bool):
  """contrib's dimension numbers of a projection, written out by name: wo's inputs are (heads, head_dim)."""
  names = [str(getattr(k, "key", k)) for k in path]
  lead = int(stacked) + int(experts and "mlp" in names and names[-1] in ("w_gate", "w_up", "w_down"))
  n_in = 2 if names[-1] == "wo" else 1
  return contrib.MuonDimensionNumbers(tuple(range(lead, lead + n_in)), tuple(range(lead + n_in, x.ndim)))


def _reference(cfg, stacked: bool, experts: bool) -> optax.GradientTransformation:
  """optax.contrib.muon on the projections (consistent_rms=0.2, Nesterov, 5 standard NS steps), optax.adamw on the
  rest with decay on matrices but the embedding, both on the clipped gradient, by the same schedule."""
  o = cfg.optim
  schedule = optim_lib.lr_schedule(o, cfg.train.steps)
  is_muon = lambda path, _: str(getattr(path[-1], "key", "")) in PROJECTIONS  # noqa: E731
  dims = lambda p: jax.tree_util.tree_map_with_path(  # noqa: E731
      lambda path, x: _dims(path, x, stacked, experts), p)
  muon = contrib.muon(schedule, ns_steps=5, beta=o.muon_momentum, eps=o.eps, weight_decay=o.weight_decay,
                      nesterov=True, consistent_rms=0.2, muon_weight_dimension_numbers=dims)
  decayed = lambda p: jax.tree_util.tree_map_with_path(  # noqa: E731
      lambda path, x: str(getattr(path[-1], "key", "")) not in ("embed", "scale"), p)  # norms: (layers, D) stacked
  adamw = optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decayed)
  labels = lambda p: jax.tree_util.tree_map_with_path(  # noqa: E731
      lambda path, x: "muon" if is_muon(path, x) else "adamw", p)
  return optax.chain(optax.clip_by_global_norm(o.grad_clip), optax.partition({"muon": muon, "adamw": adamw}, labels))


def _relative(got, want) -> dict:
  return {jax.tree_util.keystr(p): float(np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b))
          for (p, b), a in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got), strict=True)}


@pytest.mark.slow  # compiles of whole steps
@pytest.mark.parametrize("sets", [["model.scan_layers=true"],
                                  ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_expert_d_ff=32",
                                   "model.tie_embeddings=true"]], ids=["dense-stacked", "moe-tied"])
def test_muon_equals_optax_contrib_muon_after_several_steps(sets):
  """The optimizer on the model's gradients equals contrib's within 1e-6 on every parameter after STEPS updates,
  both compiled alike (NS multiplies a rounding of its input by up to 3.4^5: the two sides are fed their own
  gradients by one function); the train step, one program around the same update, equals it within 1e-5."""
  from jaxtrain.run import step
  cfg = config.load("tiny", [*SMALL, *sets])
  setup = step.Setup(cfg, mesh_of("data=1"))
  graphdef, _ = model_lib.abstract(cfg.model)
  state = setup.init()
  start = params = ours = jax.device_get(state["params"])
  ref, opt = _reference(cfg, cfg.model.scan_layers, bool(cfg.model.moe_experts)), optim_lib.optimizer(cfg)
  ref_state, our_state = ref.init(params), opt.init(params)
  grads = jax.jit(lambda p, b: grads_of(cfg, graphdef, p, b)[1])

  def one(update):  # each side compiled alone, fed its own gradients by one function
    return jax.jit(lambda p, st, b: (lambda u, st: (optax.apply_updates(p, u), st))(*update(grads(p, b), st, p)))
  ref_step, our_step = one(ref.update), one(opt.update)
  it = data.batches(cfg)
  for _ in range(STEPS):
    batch = next(it)
    state, m = setup.step(state, setup.device_batch(batch))
    assert not bool(m["skipped"])
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    (params, ref_state), (ours, our_state) = ref_step(params, ref_state, batch), our_step(ours, our_state, batch)
  it.close()
  errors = _relative(ours, params)
  assert max(errors.values()) < 1e-6, errors
  errors = _relative(jax.device_get(state["params"]), params)
  assert max(errors.values()) < 1e-5, errors
  assert min(_relative(params, start).values()) > 1e-4  # every parameter moved: nothing compared frozen with frozen


def test_the_role_table_gives_muon_to_the_projections_and_adamw_to_the_rest():
  cfg = config.load("tiny", [*SMALL, "model.tie_embeddings=false", "model.mtp_layers=1"])
  params = nnx.to_pure_dict(model_lib.abstract(cfg.model)[1])
  state = optim_lib.optimizer(cfg).init(jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), params))
  muon_mu = state.inner_states["muon"].inner_state[0].mu
  for path, x in jax.tree_util.tree_leaves_with_path(muon_mu, is_leaf=lambda x: isinstance(x, optax.MaskedNode)):
    leaf = str(getattr(path[-1], "key", ""))
    assert isinstance(x, optax.MaskedNode) == (leaf not in PROJECTIONS | {"eh_proj"}), jax.tree_util.keystr(path)


def _matrices():
  rng = np.random.default_rng(0)
  g = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
  u, _ = np.linalg.qr(g(48, 48))
  return {"gaussian": g(24, 64), "tall": g(96, 16), "rank-1": np.outer(g(32), g(40)), "orthogonal": u[:, :32],
          "ill-conditioned": (u[:, :16] * np.logspace(0, -6, 16)) @ g(16, 20), "huge": 1e30 * g(20, 30),
          "tiny": 1e-30 * g(20, 30), "one-spike": np.eye(8, 24, dtype=np.float32) * np.logspace(0, -3, 8)[:, None]}


@pytest.mark.parametrize("name", list(_matrices()))
def test_newton_schulz_equals_contrib_and_stays_within_the_guards_bound(name):
  """optax.contrib's orthogonalization (an independent implementation) of adversarial matrices: ours equals it, and
  no entry of either exceeds the quintic's invariant bound 1.2025 that NS_ENTRY_BOUND covers; bfloat16 too."""
  x = jnp.asarray(_matrices()[name])
  want = contrib.orthogonalize_via_newton_schulz(x, jnp.asarray(muon_lib.NS_COEFFS), 5, eps=1e-8)
  got = muon_lib.newton_schulz(x, 1e-8)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  assert float(jnp.linalg.norm(want, ord=2)) <= 1.2025 * (1 + 1e-4)
  low = muon_lib.newton_schulz(x.astype(jnp.bfloat16), 1e-8).astype(jnp.float32)
  assert max(float(jnp.abs(want).max()), float(jnp.abs(low).max())) <= muon_lib.NS_ENTRY_BOUND


def test_the_guard_skips_a_muon_step_its_bound_cannot_keep_finite():
  """stays_finite with Muon: a learning rate whose largest Muon move would overflow is refused before the update,
  one that cannot is not."""
  cfg = config.load("tiny", [*SMALL, "optim.weight_decay=0"])
  params = {"layers": {0: {"attn": {"wq": jnp.ones((32, 4, 8)), "wo": jnp.ones((4, 8, 32))}}},
            "final_norm": {"scale": jnp.ones((32,))}}
  # the largest Muon scale: 0.2 sqrt(32) for both; times 1.5: 1.697 >> AdamW's bound 1 at step 1
  lr_to_overflow = float(optim_lib.LIMIT / (0.2 * np.sqrt(32) * muon_lib.NS_ENTRY_BOUND))
  for lr, ok in ((lr_to_overflow * 1.01, False), (lr_to_overflow * 0.9, True)):
    c = config.load("tiny", [*SMALL, "optim.weight_decay=0", f"optim.lr={lr!r}", "optim.warmup_steps=0"])
    assert bool(optim_lib.stays_finite(c, jnp.int32(0), params)) == ok, lr
  assert cfg.optim.name == "muon"


@pytest.mark.parametrize("sets,words", [
    (["optim.name=muon", "optim.offload=host"], ["optim.name='muon'", "optim.offload='host'"]),
    (["optim.name=muon", "model.lora_rank=4"], ["optim.name='muon'", "model.lora_rank=4"]),
    (["optim.muon_momentum=0.9"], ["optim.muon_momentum=0.9", "optim.name=muon only"]),
    (["optim.name=lion"], ["optim.name='lion'", "adamw, muon"]),
])
def test_muon_combinations_it_does_not_run_are_refused_in_one_line(sets, words):
  with pytest.raises(UserError) as e:
    config.load("tiny", sets)
  assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("allowed", [set(), {"model", "train", "tokenizer", "data"}])
def test_switching_optimizer_on_resume_is_refused_in_one_line(allowed, tmp_path):
  """optim.name is a math key; its change is refused unless --allow-mismatch names `optimizer`, even where the
  other categories are allowed (the saved state is the other rule's), in one line naming both values and the way
  through. The same name resumes; with `optimizer` allowed the switch passes the check, optim.name alone (not a
  `train` mismatch) and muon_momentum with it."""
  from jaxtrain.run import checkpoint, loop
  import types
  cfgs = [config.load("tiny", sets) for sets in ([], ["optim.name=muon", "optim.muon_momentum=0.9"])]
  adamw, muon = (checkpoint.fingerprint(c, "tok", "data") for c in cfgs)
  setup_of = {id(adamw): types.SimpleNamespace(cfg=cfgs[0]), id(muon): types.SimpleNamespace(cfg=cfgs[1])}
  assert config.all_keys()["optim.name"].metadata["math"]
  for saved, current, words in ((adamw, muon, "optim.name='adamw', this run has optim.name='muon'"),
                                (muon, adamw, "optim.name='muon', this run has optim.name='adamw'")):
    with pytest.raises(UserError) as e:
      loop._same_run(current, allowed, None)(tmp_path, {"fingerprint": saved})  # noqa: SLF001
    line = str(e.value)
    assert "\n" not in line and words in line and "cannot switch optimizer" in line, line
    assert "--allow-mismatch optimizer" in line, line
    loop._same_run(current, allowed | {"optimizer"}, setup_of[id(current)])(  # noqa: SLF001
        tmp_path, {"fingerprint": saved})
  assert loop.allowed_mismatches("all") >= {"optimizer", "train"}
  old = {**muon, "train": {k: v for k, v in muon["train"].items() if k != "optim.name"}}  # before the key: adamw
  with pytest.raises(UserError, match="optim.name='adamw', this run has optim.name='muon'"):
    loop._same_run(muon, allowed, None)(tmp_path, {"fingerprint": old})  # noqa: SLF001
  with pytest.raises(UserError, match="optim.lr"):  # the switch frees optim.name, not the other train keys
    lr = {**muon, "train": {**muon["train"], "optim.lr": 1.0}}
    loop._same_run(lr, {"optimizer"}, setup_of[id(muon)])(tmp_path, {"fingerprint": adamw})  # noqa: SLF001


def _records(workdir) -> dict:
  import json
  return {r["step"]: r for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines()) if "loss" in r}


@pytest.mark.slow  # three short in-process runs
def test_an_allowed_switch_resumes_params_schedule_and_data_with_a_fresh_state(tmp_path):
  """AdamW for 2 steps, then Muon from that checkpoint with --allow-mismatch optimizer: step 3's loss (a function of
  the parameters after step 2 and the third batch only) and lr equal an uninterrupted AdamW run's; the Muon state
  it starts from has every moment zero and the schedule at update 2; step 3 then moves the parameters by Muon."""
  from jaxtrain.run import checkpoint, loop, step
  base = [s for s in SMALL if s != "optim.name=muon"] + ["checkpoint.async_save=false"]
  adamw, muon = config.load("tiny", base), config.load("tiny", [*base, "optim.name=muon"])
  loop.run(adamw, mesh_of("data=1"), tmp_path / "straight", "m", stop_at=3)
  loop.run(adamw, mesh_of("data=1"), tmp_path / "w", "m", stop_at=2)
  with pytest.raises(UserError, match="--allow-mismatch optimizer"):
    loop.run(muon, mesh_of("data=1"), tmp_path / "w", "m", stop_at=3)
  setup = step.Setup(muon, mesh_of("data=1"))
  ckpts = checkpoint.Checkpoints(tmp_path / "w" / "checkpoints", 3, 0, False)
  batches = data.batches(muon)
  state, progress, _ = loop._resume(ckpts, tmp_path / "w" / "checkpoints" / "2", setup, batches, "data=1")  # noqa: SLF001
  batches.close()
  ckpts.close()
  assert progress.step == 2 and int(state["step"]) == 2
  is_sched = lambda s: isinstance(s, optax.ScaleByScheduleState)  # noqa: E731
  scheds = [s for s in jax.tree.leaves(state["opt"], is_leaf=is_sched) if is_sched(s)]
  assert len(scheds) == 2 and all(int(s.count) == 2 for s in scheds)  # AdamW's part and Muon's part
  others = jax.tree.leaves([s for s in jax.tree.leaves(state["opt"], is_leaf=is_sched) if not is_sched(s)])
  assert others and all(not np.any(np.asarray(x)) for x in others)  # moments and their counts: zero
  loop.run(muon, mesh_of("data=1"), tmp_path / "w", "m", stop_at=3, allow_mismatch="optimizer")
  straight, switched = _records(tmp_path / "straight"), _records(tmp_path / "w")
  assert switched[3]["loss"] == pytest.approx(straight[3]["loss"], rel=1e-6)
  assert switched[3]["lr"] == pytest.approx(straight[3]["lr"], rel=1e-7)
  assert switched[2]["loss"] == pytest.approx(straight[2]["loss"], rel=1e-6)  # step 2 carried from the checkpoint


def test_the_bill_counts_one_moment_for_muons_matrices():
  """state_bytes under Muon: adam_m holds a float32 moment of every trained parameter, adam_v only the AdamW ones'
  (counted here by name, apart from the role table)."""
  from jaxtrain.analysis import memory
  from jaxtrain.run import step
  setup = step.Setup(config.load("tiny", [*SMALL, "model.scan_layers=true"]), mesh_of("data=1"))
  params = nnx.to_pure_dict(setup.abstract_params)
  size = lambda keep: sum(4 * int(np.prod(x.shape)) for p, x in jax.tree_util.tree_leaves_with_path(params)  # noqa: E731
                          if keep(str(getattr(p[-1], "key", ""))))
  st = memory.state_bytes(setup)
  assert st["adam_m"] == size(lambda _: True) and st["adam_v"] == size(lambda leaf: leaf not in PROJECTIONS)
  assert st["adam_v"] < st["adam_m"]


@pytest.mark.parametrize("spec,layers,share", [("fsdp=4", 4, 1), ("fsdp=2,tensor=2", 4, 1), ("fsdp=4", 6, 2)])
def test_owner_devices_orthogonalize_a_share_of_the_stack(spec, layers, share):
  """The owner route (muon.route): on a mesh of N devices that splits each matrix of a scanned stack of L layers,
  the per-device FLOPs of the optimized program's matmuls (each dot's, times its loop's trip count) in the
  orthogonalization of every Muon matrix are those of ceil(L/N) layers (a device's share: L=6 on 4 devices pads to
  8, 2 each), not of all L as when every device repeats each matrix's Newton-Schulz; and the result equals one
  device's (1e-5)."""
  from jaxtrain.analysis import gpu_compile
  from jaxtrain.run import step
  cfg = config.load("tiny", [*SMALL, "model.scan_layers=true", f"model.n_layers={layers}"])
  setup = step.Setup(cfg, mesh_of(spec))
  params = nnx.to_pure_dict(setup.abstract_params)
  stored = {jax.tree_util.keystr(p): sh for p, sh in jax.tree_util.tree_leaves_with_path(setup.layout.stored)}
  rng = np.random.default_rng(0)
  work = {jax.tree_util.keystr(p): (roles.of(cfg.model, p), rng.standard_normal(x.shape).astype(np.float32))
          for p, x in jax.tree_util.tree_leaves_with_path(params) if roles.of(cfg.model, p).muon}
  assert {k.rsplit("'", 2)[-2] for k in work} == PROJECTIONS

  def flops_and_out(shardings):  # None: one device, as it lies
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    placed = {k: sh or one for k, sh in shardings.items()}
    fn = lambda xs: {k: muon_lib.orthogonalize(x, work[k][0], shardings[k], jnp.float32, 1e-8)  # noqa: E731
                     for k, x in xs.items()}
    jitted = jax.jit(fn, out_shardings=placed)
    xs = {k: jax.device_put(x, placed[k]) for k, (_, x) in work.items()}
    hlo = gpu_compile.Hlo.parse(jitted.lower(xs).compile().as_text())
    shapes = {i.name: i.shape for i in hlo.instrs}
    dots = sum(gpu_compile.dot_flops(i, shapes) * hlo.times.get(i.computation, 1)
               for i in hlo.instrs if i.opcode == "dot")
    return dots, jitted(xs)

  alone, want = flops_and_out(dict.fromkeys(work))
  split, got = flops_and_out({k: stored[k] for k in work})
  assert split / alone == pytest.approx(share / layers, rel=0.15), (split, alone)
  assert all(muon_lib.route(r, x.shape, muon_lib.full_spec(stored[k], x.ndim), setup.mesh).way == "owner"
             for k, (r, x) in work.items())
  for k in work:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("spec,sets,said,layers", [
    ("fsdp=4", ["model.scan_layers=true"], "7 parameters on owner devices: all-to-all over fsdp", 1),
    ("fsdp=2,tensor=2", ["model.scan_layers=true"], "7 parameters on owner devices: all-to-all over fsdpxtensor", 1),
    ("fsdp=4", [], "14 parameters gathered whole on each device of fsdp", 1),
    ("pipeline=2,fsdp=2", ["model.scan_layers=true", "model.n_layers=4", "train.batch_size=8",
                           "train.microbatches=2"], "7 parameters on owner devices: all-to-all over fsdp", 1),
    ("data=4", ["model.scan_layers=true"], "7 parameters whole as stored", 2)])
def test_the_bill_says_which_way_muon_makes_each_matrix_whole(spec, sets, said, layers):
  """The bill's workspace names muon.route's way per Muon parameter: a scanned stack split by the mesh on owner
  devices (a pipeline stage's layers too), an unscanned layer's lone matrices gathered, matrices no axis splits as
  stored; the peak holds the largest parameter's matrices a device orthogonalizes at once: on owner devices its
  share (ceil(2 layers / 4) = 1 layer; a stage's 2 layers over fsdp=2), as stored the whole stack."""
  from jaxtrain.analysis import memory
  from jaxtrain.run import step
  setup = step.Setup(config.load("tiny", [*SMALL, *sets]), mesh_of(spec))
  most, ways = memory.muon_work(setup)
  assert ways == said
  d, f = 32, 64  # one layer's largest matrix (d_model x d_ff): three copies and two Gram matrices, float32
  assert most == layers * (3 * d * f + 2 * d * d) * 4
