"""The GPU fast path on CPU: attention selection, remat policies against no remat."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.model import attention
from jaxtrain.core import config
from jaxtrain.model import transformer as model_lib
from jaxtrain.run import step as step_lib
from jaxtrain.core.errors import UserError
from jaxtrain.parallel import devices

CFG = config.load("tiny", ["model.dtype=float32", "model.n_layers=2", "model.d_model=32", "model.d_ff=64",
                           "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=8", "model.vocab_size=64"]).model


def test_attention_selection_picks_the_reference_on_cpu():
  bf16 = dataclasses.replace(CFG, dtype="bfloat16", head_dim=64)
  impl, reason = attention.select(bf16, 128)
  assert impl == "xla" and "cpu" in reason
  assert attention.select(dataclasses.replace(bf16, attention="xla"))[0] == "xla"
  with pytest.raises(UserError, match="model.attention=cudnn is not supported here: backend is cpu"):
    attention.select(dataclasses.replace(bf16, attention="cudnn"), 128)


def test_attention_selection_rules_on_a_gpu():
  """The conditions, for an A100 target (head_dim at most 128) and an H100 (256)."""
  bf16 = dataclasses.replace(CFG, dtype="bfloat16", head_dim=64)
  assert attention.select(bf16, 128, info=devices.of("A100"))[0] == "cudnn"
  for cfg, seq, why in [(dataclasses.replace(bf16, dtype="float32"), 128, "model.dtype=float32"),
                        (dataclasses.replace(bf16, head_dim=60), 128, "model.head_dim=60"),
                        (dataclasses.replace(bf16, head_dim=192), 128, "model.head_dim=192"),
                        (bf16, 127, "train.seq_len=127")]:
    impl, reason = attention.select(cfg, seq, info=devices.of("A100"))
    assert impl == "xla" and why in reason
    with pytest.raises(UserError, match=why):
      attention.select(dataclasses.replace(cfg, attention="cudnn"), seq, info=devices.of("A100"))
  assert attention.select(dataclasses.replace(bf16, head_dim=192), 128, info=devices.of("H100"))[0] == "cudnn"


def test_fused_call_masks_segments_like_the_reference():
  """The arguments `fused` gives jax.nn.dot_product_attention (causal + segment mask, GQA),
  run with its XLA implementation, against the model's reference; packed and unpacked."""
  rng = np.random.default_rng(0)
  B, L, H, K, E = 2, 12, 4, 2, 8
  q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in [(B, L, H, E), (B, L, K, E), (B, L, K, E)])
  for seg in (jnp.asarray([[1] * 5 + [2] * 4 + [0] * 3, [1] * 12]), jnp.ones((B, L), jnp.int32)):
    f = lambda q, k, v: attention.fused(q, k, v, seg, implementation="xla")
    r = lambda q, k, v: model_lib.attention(q, k, v, seg)
    np.testing.assert_allclose(f(q, k, v), r(q, k, v), rtol=1e-5, atol=1e-5)
    gf = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2))(q, k, v)
    gr = jax.grad(lambda *a: jnp.sum(r(*a) ** 2), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(gf, gr):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@functools.lru_cache(maxsize=None)
def _loss_and_grads(cfg):
  return _loss_and_grads_of(*nnx.split(model_lib.Transformer(cfg, nnx.Rngs(0))))


def _loss_and_grads_of(graphdef, params):
  rng = np.random.default_rng(1)
  B, L = 2, 16
  toks = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, L + 1)), jnp.int32)
  seg = jnp.asarray([[1] * 9 + [2] * 7, [1] * 16], jnp.int32)
  pos = jnp.asarray([list(range(9)) + list(range(7)), list(range(16))], jnp.int32)
  mb = {"inputs": toks[:, :-1], "targets": toks[:, 1:], "positions": pos, "segment_ids": seg,
        "loss_mask": jnp.ones((B, L), bool)}
  return jax.jit(jax.value_and_grad(lambda p: step_lib.token_loss_sum(graphdef, p, mb)))(params)


@pytest.mark.parametrize("policy", ["full", "save_dots", "save_named", "offload_named"])
def test_remat_policy_gives_the_loss_and_gradients_of_none(policy):
  loss_ref, g_ref = _loss_and_grads(CFG)
  loss, g = _loss_and_grads(dataclasses.replace(CFG, remat=policy))
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_unknown_xla_flag_is_dropped_with_a_warning(tmp_path, capsys):
  from jaxtrain.parallel import xla_flags
  cache = tmp_path / "flags.json"
  env = {"XLA_FLAGS": "--xla_dump_to=/tmp/user_choice"}
  added = xla_flags.apply("none", "--xla_jaxtrain_no_such_flag=1 --xla_gpu_enable_latency_hiding_scheduler=true "
                          "--xla_dump_to=/tmp/ignored", environ=env, cache=cache)
  assert added == ["--xla_gpu_enable_latency_hiding_scheduler=true"]
  assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/user_choice --xla_gpu_enable_latency_hiding_scheduler=true"
  err = capsys.readouterr().err.strip().splitlines()
  assert err == ["warning: dropping XLA flag(s) this jaxlib does not know: --xla_jaxtrain_no_such_flag=1"]
  # The verdicts are cached: a second call decides without a probe.
  assert xla_flags.validate(["--xla_jaxtrain_no_such_flag=2"], cache)[1] == ["--xla_jaxtrain_no_such_flag=2"]
  # What is kept really starts XLA (the independent check: a fresh process with those flags).
  import subprocess, sys
  r = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True, text=True,
                     env={**__import__("os").environ, "XLA_FLAGS": env["XLA_FLAGS"], "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 0, r.stderr[-500:]


def test_gpu_default_preset_flags_are_known_to_this_jaxlib(tmp_path):
  from jaxtrain.parallel import xla_flags
  kept, dropped = xla_flags.validate(xla_flags.PRESETS["gpu-default"], tmp_path / "flags.json")
  assert dropped == [] and len(kept) == len(xla_flags.PRESETS["gpu-default"])


def crc32c(data: bytes) -> int:
  """CRC-32C (Castagnoli), bit by bit: the test's own reference for the TFRecord framing."""
  c = 0xFFFFFFFF
  for b in data:
    c ^= b
    for _ in range(8):
      c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
  return c ^ 0xFFFFFFFF


def _read_events(path):
  """(step, {tag: value}) per record, decoded with Google's protobuf runtime from a
  descriptor of TensorBoard's Event/Summary messages (field numbers from event.proto)."""
  import struct
  from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
  fd = descriptor_pb2.FileDescriptorProto(name="tb_event_test.proto", package="tbtest", syntax="proto3")
  F = descriptor_pb2.FieldDescriptorProto
  def msg(name, *fields):
    m = fd.message_type.add(name=name)
    for fname, num, ftype, label, tname in fields:
      f = m.field.add(name=fname, number=num, type=ftype, label=label)
      if tname:
        f.type_name = tname
  msg("Value", ("tag", 1, F.TYPE_STRING, F.LABEL_OPTIONAL, None), ("simple_value", 2, F.TYPE_FLOAT, F.LABEL_OPTIONAL, None))
  msg("Summary", ("value", 1, F.TYPE_MESSAGE, F.LABEL_REPEATED, ".tbtest.Value"))
  msg("Event", ("wall_time", 1, F.TYPE_DOUBLE, F.LABEL_OPTIONAL, None), ("step", 2, F.TYPE_INT64, F.LABEL_OPTIONAL, None),
      ("file_version", 3, F.TYPE_STRING, F.LABEL_OPTIONAL, None),
      ("summary", 5, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, ".tbtest.Summary"))
  pool = descriptor_pool.DescriptorPool()
  pool.Add(fd)
  Event = message_factory.GetMessageClass(pool.FindMessageTypeByName("tbtest.Event"))
  assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value (RFC 3720)
  data, out, i = path.read_bytes(), [], 0
  while i < len(data):
    (n,) = struct.unpack_from("<Q", data, i)
    body = data[i + 12:i + 12 + n]
    c = crc32c(body)
    assert struct.unpack_from("<I", data, i + 12 + n)[0] == (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF
    ev = Event.FromString(body)
    out.append((ev.file_version, ev.step, {v.tag: v.simple_value for v in ev.summary.value}))
    i += 12 + n + 4
  return out


def test_tensorboard_scalars_and_profile_trace_next_to_metrics(run_cli, tmp_path):
  import json
  r = run_cli("jaxtrain.train", "--mesh", "dp=2", "--steps", "3", "--workdir", "w",
              "--set", "train.batch_size=4", "--set", "train.seq_len=32", "--set", "train.profile_steps=2-3",
              "--set", "train.xla_flags=gpu-default", "--set", "train.xla_flags_extra=--xla_jaxtrain_bogus=1",
              "--set", "model.remat=save_named", env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
  assert r.returncode == 0, r.stderr[-2000:]
  assert "attention: xla (reference XLA attention: backend is cpu, not a CUDA GPU); remat save_named" in r.stdout
  assert "dropping XLA flag(s) this jaxlib does not know: --xla_jaxtrain_bogus=1" in r.stderr
  assert "xla flags: 12 added to XLA_FLAGS (preset gpu-default)" in r.stdout
  w = tmp_path / "w"
  records = [json.loads(l) for l in (w / "metrics.jsonl").read_text().splitlines()]
  (event_file,) = (w / "tb").glob("events.out.tfevents.*")
  events = _read_events(event_file)
  assert events[0][0] == "brain.Event:2"
  by_step = {}
  for _, step, scalars in events[1:]:  # one event per scalar and step
    by_step.setdefault(step, {}).update(scalars)
  assert sorted(by_step) == [rec["step"] for rec in records] == [1, 2, 3]
  for rec in records:
    scalars = by_step[rec["step"]]
    for k in ("loss", "lr", "grad_norm", "tokens", "tokens_per_sec", "step_time_s"):
      assert scalars[k] == pytest.approx(rec[k], rel=1e-6)
    assert "mfu" not in scalars and "skipped" not in scalars  # None and bool are not scalars
  traces = list((w / "profile").rglob("*.xplane.pb"))
  assert traces and all(t.stat().st_size > 0 for t in traces)


@pytest.mark.parametrize("setting, words", [
    ("model.attention=cudnn", "model.attention=cudnn is not supported here: backend is cpu"),
    ("run.profile_steps=7-5", "run.profile_steps='7-5'"),
    ("run.xla_flags_extra=xla_no_dashes", "run.xla_flags_extra: xla_no_dashes is not a flag"),
])
def test_fast_path_user_errors_are_one_line(run_cli, setting, words):
  r = run_cli("jaxtrain.train", "--mesh", "dp=2", "--steps", "1", "--workdir", "w", "--set", setting,
              "--set", "train.batch_size=4", "--set", "train.seq_len=32")
  assert r.returncode == 2, (r.stdout, r.stderr)
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and words in lines[0], r.stderr


def test_memory_bill_counts_activations_for_the_remat_setting():
  from jaxtrain.analysis import memory
  from tests.helpers import mesh_of
  cfg = config.load("tiny")
  mesh = mesh_of("dp=2")
  for remat in ("none", "full"):
    setup = step_lib.Setup(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=remat)), mesh)
    b = memory.bill(setup, memory.param_rows(setup), 0.0)
    assert b.items["activations"] == sum(memory.activations(setup.cfg, mesh, remat, setup.plan.attention,
                                                            logits_residual=False).values())
  assert b.items["activations"] < sum(memory.activations(cfg, mesh, "none", logits_residual=False).values())



def _restack(params_unscanned, n_layers):
  """The unscanned pure params with layers/0..n-1 stacked into one `layers` subtree."""
  pure = nnx.to_pure_dict(params_unscanned)
  per_layer = [pure["layers"][i] for i in range(n_layers)]
  return {**pure, "layers": jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)}


@pytest.mark.parametrize("extra", [{}, {"remat": "full"}, {"moe_experts": 4, "moe_top_k": 2}])
def test_scanned_layers_give_the_loss_and_gradients_of_unscanned(extra):
  cfg = dataclasses.replace(CFG, n_layers=3, **extra)
  loss_ref, g_ref = _loss_and_grads(cfg)
  scanned = dataclasses.replace(cfg, scan_layers=True)
  graphdef, params = nnx.split(model_lib.Transformer(scanned, nnx.Rngs(0)))
  # Same weights: the unscanned model's, restacked independently of model.stack_blocks.
  _, unscanned_params = nnx.split(model_lib.Transformer(cfg, nnx.Rngs(0)))
  nnx.replace_by_pure_dict(params, _restack(unscanned_params, cfg.n_layers))
  loss, g = _loss_and_grads_of(graphdef, params)
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
  expected = _restack(g_ref, cfg.n_layers)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(g)), jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))
  # The stacked params carry the `layers` logical axis first.
  axes = {v.get_metadata()["axes"] for _, v in nnx.iter_graph(model_lib.Transformer(scanned, nnx.Rngs(0)).layers)
          if isinstance(v, nnx.Param)}
  assert all(a[0] == "layers" for a in axes)


def test_scan_layers_with_mixed_moe_layers_is_a_user_error():
  with pytest.raises(UserError, match="model.scan_layers=true needs identical layers; model.moe_every=2"):
    config.load("tiny", ["model.scan_layers=true", "model.moe_experts=4", "model.moe_every=2"])


def test_scanned_layers_train_shard_and_resume(run_cli, tmp_path):
  import json
  args = ["--mesh", "fsdp=2,tp=2", "--workdir", "w", "--set", "model.scan_layers=true", "--set", "train.batch_size=4",
          "--set", "train.seq_len=32", "--set", "checkpoint.interval=2", "--set", "train.tensorboard=false"]
  r = run_cli("jaxtrain.train", *args, "--steps", "2")
  assert r.returncode == 0, r.stderr[-2000:]
  r = run_cli("jaxtrain.train", *args, "--steps", "3")
  assert r.returncode == 0, r.stderr[-2000:]
  assert "resumed from" in r.stdout and "at step 2" in r.stdout
  records = [json.loads(l) for l in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
  assert [rec["step"] for rec in records] == [1, 2, 3] and all(np.isfinite(rec["loss"]) for rec in records)
  assert not (tmp_path / "w" / "tb").exists()
