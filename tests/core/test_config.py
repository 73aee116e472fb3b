import dataclasses
import re

import numpy as np
import pytest

from jaxtrain.core import config
from jaxtrain.model import transformer as model
from jaxtrain.core.errors import UserError


@pytest.mark.parametrize("name, count", [("llama3-8b", 8_030_261_248), ("llama3-1b", 1_235_814_400)])
def test_real_shapes_parameter_count(name, count):
  _, state = model.abstract(config.load(name).model)
  assert model.param_count(state) == count


def test_overrides_are_typed():
  cfg = config.load("tiny", ["optim.lr=1e-4", "model.tie_embeddings=true", "model.dtype=float32", "train.steps=7"])
  assert cfg.optim.lr == 1e-4 and cfg.model.tie_embeddings is True and cfg.model.dtype == "float32"
  assert cfg.train.steps == 7


@pytest.mark.parametrize("override, words", [
    ("train.nope=1", ["unknown config key 'train.nope'", "batch_size", "seq_len"]),
    ("optimizer.lr=1", ["unknown config section 'optimizer'", "model, optim, train, run, loss_scale, checkpoint"]),
    ("model.dtype=float64", ["model.dtype='float64'", "bfloat16, float16, float32"]),
    ("train.batch_size=1.5", ["train.batch_size='1.5'", "not an integer"]),
    ("optim.lr=fast", ["not a number"]),
    ("train.batch_size=0", ["below its minimum"]),
    ("train.microbatches=3", ["must divide train.batch_size=16"]),
    ("model.lora_rank=4 model.lora_targets=q,wq", ["model.lora_targets='q,wq'", "q, k, v, o, gate, up, down"]),
    ("model.lora_rank=4 model.lora_targets=q,q", ["name each projection once"]),
    ("model.lora_rank=4 model.attention_type=mla", ["model.lora_targets='q,v'", "v not in model.attention_type='mla'",
                                                    "its projections: q, o, kv_a, kv_b, gate, up, down"]),
    ("model.lora_rank=4 model.attention_type=mla model.q_lora_rank=8 model.lora_targets=q,kv_b",
     ["q not in model.attention_type='mla' (q_lora_rank=8)", "o, q_a, q_b, kv_a, kv_b"]),
    ("model.lora_rank=4 model.lora_targets=q_a,kv_b", ["q_a, kv_b not in model.attention_type='gqa'", "q, k, v, o"]),
    ("model.lora_rank=4 optim.offload=host", ["model.lora_rank=4 with optim.offload='host' is not supported"]),
    ("model.lora_rank=4 model.fp8=tensorwise", ["model.lora_rank=4 with model.fp8='tensorwise'"]),
    ("model.lora_base_dtype=nf4", ["model.lora_base_dtype='nf4'", "model.lora_rank > 0"]),
    ("model.lora_rank=4 model.lora_base_dtype=fp4", ["model.lora_base_dtype='fp4'", "none, nf4, int8"]),
    ("lr=1", ["section.key=value"]),
])
def test_bad_overrides_name_the_key_and_what_is_allowed(override, words):
  with pytest.raises(UserError) as e:
    config.load("tiny", override.split(" "))
  for w in words:
    assert w in str(e.value)


def test_lora_on_moe_and_mla_loads():
  cfg = config.load("tiny", ["model.lora_rank=4", "model.moe_experts=4", "model.attention_type=mla",
                             "model.q_lora_rank=8", "model.lora_targets=q_a,q_b,kv_a,kv_b,o,gate,up,down"])
  assert cfg.model.lora_target_names() == ("q_a", "q_b", "kv_a", "kv_b", "o", "gate", "up", "down")


def test_unknown_key_in_a_file_is_rejected(tmp_path):
  p = tmp_path / "c.toml"
  p.write_text("[train]\nbatch_sise = 4\n")
  with pytest.raises(UserError, match="unknown config key 'train.batch_sise'"):
    config.load(str(p))
  with pytest.raises(UserError, match="presets: .*tiny"):
    config.load("no-such-preset")


def test_help_lists_every_key_with_type_default_and_meaning():
  text = config.help_text()
  for section, cls in config.SECTIONS.items():
    for f in dataclasses.fields(cls):
      line = next(l for l in text.splitlines() if l.strip().startswith(f"{section}.{f.name} ("))
      assert f"default {f.default!r}" in line
  assert "one of bfloat16, float16, float32" in text


def test_renamed_keys_load_from_old_preset_files(tmp_path, capsys):
  p = tmp_path / "old.toml"
  p.write_text("[train]\nlr = 1e-4\nlog_every = 3\nsteps = 5\n")
  cfg = config.load(str(p))
  assert (cfg.optim.lr, cfg.run.log_every, cfg.train.steps) == (1e-4, 3, 5)
  assert "train.lr -> optim.lr" in capsys.readouterr().err


@pytest.mark.parametrize("sets, trackers", [
    ([], ["tensorboard"]),
    (["run.trackers=tensorboard,mlflow"], ["tensorboard", "mlflow"]),
    (["run.trackers= wandb , mlflow "], ["wandb", "mlflow"]),
    (["run.trackers="], []),
    (["run.tensorboard=false"], []),  # the older switch: tensorboard off
    (["train.tensorboard=false"], []),
])
def test_trackers_and_the_older_tensorboard_switch(sets, trackers):
  assert config.load("tiny", sets).run.tracker_names() == trackers


def test_tensorboard_switch_of_an_old_file_under_a_newer_trackers_list(tmp_path):
  p = tmp_path / "old.toml"
  p.write_text("[run]\ntensorboard = false\n")
  assert config.load(str(p)).run.tracker_names() == []
  assert config.load(str(p), ["run.trackers=mlflow"]).run.tracker_names() == ["mlflow"]  # --set is the later layer
  assert config.load(str(p), ["run.tensorboard=true"]).run.tracker_names() == ["tensorboard"]
  p.write_text("[run]\ntensorboard = true\ntrackers = 'tensorboard,wandb'\n")  # in one layer: no one meaning
  with pytest.raises(UserError, match="both set run.trackers; give run.trackers only"):
    config.load(str(p))
  with pytest.raises(UserError, match="--set run.trackers=wandb and --set run.tensorboard=false both set run.trackers"):
    config.load("tiny", ["run.trackers=wandb", "run.tensorboard=false"])


@pytest.mark.parametrize("setting, words", [
    ("run.trackers=tensorbord", "run.trackers='tensorbord': unknown tracker tensorbord; name each once, "
     "comma-separated, any of: tensorboard, wandb, mlflow (empty = none)"),
    ("run.trackers=wandb,wandb", "run.trackers='wandb,wandb': a tracker named twice"),
    ("run.trackers=wandb,,mlflow", "run.trackers 'wandb,,mlflow': item 2 of 3 is empty"),
])
def test_bad_trackers_are_one_line(setting, words):
  with pytest.raises(UserError) as e:
    config.load("tiny", [setting])
  assert str(e.value) == words or str(e.value).startswith(words)


@pytest.mark.parametrize("setting, words", [
    ("optim.lr=nan", "optim.lr=nan is not a finite number"),
    ("optim.b2=1.0", "optim.b2=1.0 must be less than 1.0"),
    ("optim.eps=0", "optim.eps=0.0 must be greater than 0.0"),
])
def test_float_keys_have_bounds(setting, words):
  with pytest.raises(UserError, match=words.replace(".", r"\.")):
    config.load("tiny", [setting])


def test_scan_layers_with_mixed_moe_layers_is_a_user_error():
  with pytest.raises(UserError, match="model.scan_layers=true needs identical layers; model.moe_every=2"):
    config.load("tiny", ["model.scan_layers=true", "model.moe_experts=4", "model.moe_every=2"])
  # dense first layers scan as their own stack, which a pipeline cannot split
  from jaxtrain.parallel import pipeline
  from tests.helpers import mesh_of
  cfg = config.load("moe-deepseek-tiny", ["model.scan_layers=true"])
  with pytest.raises(UserError, match="pipeline=2 cannot split two layer stacks; model.moe_first_dense=1"):
    pipeline.check(cfg, mesh_of("pp=2"))


# Written out by hand, not read from the `math` flags in config.py. A key changes the math
# when runs that differ only in it compute different numbers from the same start (or save
# state that the other cannot resume); such a key must stop a resume that changes it.
MATH_KEYS = {
    # the model's shapes and numerics
    "model.vocab_size", "model.d_model", "model.n_layers", "model.n_heads", "model.n_kv_heads", "model.head_dim",
    "model.lora_rank", "model.lora_alpha", "model.lora_targets", "model.lora_base_dtype",
    "model.d_ff", "model.rope_theta", "model.rope_scaling", "model.rope_factor", "model.rope_low_freq_factor",
    "model.rope_high_freq_factor", "model.rope_original_max_position", "model.norm_eps", "model.tie_embeddings",
    "model.init_std", "model.dtype", "model.attention_logits_dtype", "model.head_logits_dtype",
    "model.fp8",  # FP8 projection matmuls
    # mixture of experts: routing, capacity, losses and expert shapes
    "model.moe_experts", "model.moe_top_k", "model.moe_every", "model.moe_capacity_factor", "model.moe_aux_weight",
    "model.moe_z_weight", "model.moe_group_size", "model.moe_dropless", "model.moe_expert_d_ff",
    "model.moe_shared_experts", "model.moe_first_dense", "model.moe_router", "model.moe_bias_rate",
    "model.moe_aux_convention",
    "model.qk_norm", "model.moe_norm_top_k",  # Qwen3: per-head q/k norms; unnormalized top-k weights
    "model.sliding_window", "model.layer_types", "model.attention_sinks",  # local layers' windows; sink logits
    "model.attention_bias", "model.moe_bias", "model.mlp_activation", "model.swiglu_alpha",  # GPT-OSS's biases
    "model.swiglu_limit", "model.rope_truncate",  # and its clamped SwiGLU; YaRN's correction range not truncated
    "model.norm_convention", "model.post_norms", "model.embed_scale",  # Gemma 3
    "model.rope_local_theta", "model.attention_scale",
    # DeepSeek-V3: YaRN, multi-head latent attention, group-limited routing, multi-token prediction
    "model.rope_beta_fast", "model.rope_beta_slow", "model.rope_mscale", "model.rope_mscale_all_dim",
    "model.attention_type", "model.q_lora_rank", "model.kv_lora_rank", "model.qk_nope_head_dim",
    "model.qk_rope_head_dim", "model.v_head_dim", "model.moe_n_group", "model.moe_topk_group", "model.moe_routed_scale",
    "model.mtp_layers", "model.mtp_weight",
    # stacked layers: the same numbers, but the saved parameter tree has another shape
    "model.scan_layers",
    # the optimizer and its schedule (train.steps sets the decay length)
    "optim.name", "optim.muon_momentum", "optim.qk_clip", "optim.state_dtype",
    "optim.lr", "optim.warmup_steps", "optim.min_lr_ratio", "optim.weight_decay", "optim.b1", "optim.b2", "optim.eps",
    "optim.grad_clip", "train.steps", "train.batch_size", "train.seq_len", "train.seed",
    # loss scaling changes which steps are skipped and the float16 gradients
    "loss_scale.mode", "loss_scale.initial", "loss_scale.growth_interval", "loss_scale.growth_factor",
    "loss_scale.backoff_factor", "loss_scale.min", "loss_scale.max",
    # what is trained on
    "data.text_field", "data.weights", "data.eval_fraction",
    # the objective: DPO (train.objective=dpo) and its beta
    "train.objective", "train.dpo_beta",
    # each step's batch (the ramp), the schedule in tokens, the LR scaled by the batch
    "train.batch_ramp", "train.tokens", "optim.warmup_tokens", "optim.lr_reference_batch", "optim.lr_batch_scaling",
}
# Math keys naming files: compared by the digest of what they name, not by their text.
CONTENT_KEYS = {"data.source", "data.tokenizer"}
# How the same math is executed, observed, evaluated or saved.
RUN_KEYS = {
    "model.moe_grouped_matmul", "model.attention", "model.attention_max_segments", "model.remat",
    "train.microbatches", "train.max_skipped_in_a_row", "train.eval_interval", "train.loss_chunk_tokens",
    "train.eval_tasks", "train.eval_tasks_interval", "train.eval_tasks_limit", "train.eval_include_path",
    "run.log_every", "run.sequence_parallel", "run.xla_flags", "run.xla_flags_extra", "run.xla_flags_unknown",
    "run.trackers",
    "run.profile_steps", "run.fit_check", "run.hang_timeout_s", "run.hang_first_step_s",
    "checkpoint.interval", "checkpoint.keep", "checkpoint.keep_every", "checkpoint.async_save", "checkpoint.on_damaged",
    "checkpoint.verify", "distributed.heartbeat_timeout_s", "distributed.init_timeout_s",
    "data.eval_source", "data.eval_batches", "data.workers", "data.prefetch", "data.verify",
    "pipeline.schedule", "pipeline.virtual_stages", "optim.zero_stage", "optim.offload",
    "optim.in_backward",  # the update inside the backward: the same update, the gradient never whole
    "model.sequence_attention",  # ring or ulysses: the same attention, split another way
}


def test_every_key_declares_whether_it_changes_the_math_as_listed_here():
  keys = config.all_keys()
  assert not (MATH_KEYS & RUN_KEYS) and not (CONTENT_KEYS & (MATH_KEYS | RUN_KEYS))
  # A new key must be classified here too (a person decides, not the flag under test).
  assert set(keys) == MATH_KEYS | CONTENT_KEYS | RUN_KEYS, set(keys) ^ (MATH_KEYS | CONTENT_KEYS | RUN_KEYS)
  for dotted, field in keys.items():
    assert field.metadata["doc"], dotted
    assert field.metadata["math"] is (dotted in MATH_KEYS | CONTENT_KEYS), dotted
    assert field.metadata["content"] is (dotted in CONTENT_KEYS), dotted


@pytest.mark.slow
def test_a_run_key_leaves_the_losses_alone_and_a_math_key_changes_them():
  """Two keys of each list, trained: the independent check that the lists above are right."""
  from tests.helpers import trajectory
  sets = ["model.dtype=float32", "train.batch_size=4", "train.seq_len=32", "model.n_layers=1"]
  base = trajectory(config.load("tiny", sets), "dp=1", 3)[:, 0]
  for setting in ("model.remat=full", "train.loss_chunk_tokens=32"):  # 32 of 128 tokens: 4 loss chunks
    assert setting.split("=")[0] in RUN_KEYS
    np.testing.assert_allclose(trajectory(config.load("tiny", [*sets, setting]), "dp=1", 3)[:, 0], base, rtol=1e-5,
                               err_msg=setting)
  for setting in ("optim.lr=0.03", "model.init_std=0.05"):
    assert setting.split("=")[0] in MATH_KEYS
    other = trajectory(config.load("tiny", [*sets, setting]), "dp=1", 3)[:, 0]
    assert np.max(np.abs(other - base) / base) > 1e-3, (setting, other, base)


def test_layer_types_give_each_layer_its_window_and_refuse_bad_values_in_one_line():
  """The presets (empty: every layer; alternate: local first; a:b), an explicit list, and what is refused."""
  def windows(lt, n=6, w=4):
    return config.load("tiny", [f"model.n_layers={n}", f"model.sliding_window={w}", f"model.layer_types={lt}"]
                       ).model.layer_windows()
  assert windows("") == (4,) * 6 and windows("alternate") == (4, 0, 4, 0, 4, 0)
  assert windows("5:1", n=7) == (4, 4, 4, 4, 4, 0, 4) and windows("local, global,global,local,local,local") == (
      4, 0, 0, 4, 4, 4)
  assert windows("alternate", w=0) == (0,) * 6  # no window: every layer global (layer_types reported ignored)
  for bad, words in (("every", "is not a known pattern"), ("local,global", "has 2 entries for model.n_layers=6"),
                     ("0:0", "a:b needs a + b > 0")):
    with pytest.raises(UserError, match=re.escape(f"model.layer_types={bad!r}") + r"\W+" + re.escape(words)) as e:
      windows(bad)
    assert "\n" not in str(e.value)
  with pytest.raises(UserError, match="model.attention_sinks=true is for grouped-query attention"):
    config.load("tiny", ["model.attention_type=mla", "model.attention_sinks=true"])
  with pytest.raises(UserError, match="model.attention_bias=true is for grouped-query attention"):
    config.load("tiny", ["model.attention_type=mla", "model.attention_bias=true"])
  with pytest.raises(UserError, match=r"model.moe_bias=true needs model.moe_experts > 0"):
    config.load("tiny", ["model.moe_bias=true"])
