"""Typed configuration: dataclasses, TOML presets, `--set section.key=value` overrides.

Every key is declared once below with its type, default and meaning. Unknown keys and
ill-typed values are user errors that name the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from jaxtrain.errors import UserError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def key(default: Any, doc: str, *, min: float | None = None):  # noqa: A002
  """A config field: its default, one-line meaning and an optional lower bound."""
  return dataclasses.field(default=default, metadata={"doc": doc, "min": min})


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int = key(512, "Embedding rows; >= the tokenizer's vocabulary (pad up for sharding).", min=1)
  d_model: int = key(128, "Residual stream width.", min=1)
  n_layers: int = key(2, "Number of transformer blocks.", min=1)
  n_heads: int = key(8, "Query heads.", min=1)
  n_kv_heads: int = key(4, "Key/value heads (grouped-query attention); divides n_heads.", min=1)
  head_dim: int = key(16, "Width of one attention head.", min=1)
  d_ff: int = key(256, "Hidden width of the SwiGLU MLP.", min=1)
  rope_theta: float = key(10000.0, "RoPE base frequency.", min=1.0)
  norm_eps: float = key(1e-5, "RMSNorm epsilon.", min=0.0)
  tie_embeddings: bool = key(False, "Share the input embedding with the output projection.")
  init_std: float = key(0.02, "Std of the normal initializer of embeddings and projections.", min=0.0)
  dtype: Literal["bfloat16", "float16", "float32"] = key(
      "bfloat16", "Compute dtype. Parameters, Adam moments, logits and the loss are always float32.")
  moe_experts: int = key(0, "Experts per mixture-of-experts layer; 0 = dense MLP in every layer.", min=0)
  moe_top_k: int = key(2, "Experts each token is routed to (weights renormalized over them).", min=1)
  moe_every: int = key(1, "Layer i is MoE when (i + 1) % moe_every == 0; 1 = every layer.", min=1)
  moe_capacity_factor: float = key(
      1.25, "Expert capacity ceil(factor * tokens * top_k / experts) per device's tokens; 0 = never drop.", min=0.0)
  moe_aux_weight: float = key(0.01, "Weight of the load-balancing loss added to the training loss.", min=0.0)
  moe_z_weight: float = key(0.001, "Weight of the router z-loss added to the training loss.", min=0.0)
  attention: Literal["auto", "xla", "cudnn"] = key(
      "auto", "Attention kernel: auto = cuDNN fused where supported, else XLA reference; xla; cudnn (error if unsupported).")
  scan_layers: bool = key(
      False, "Stack the blocks' params on a leading `layers` axis and run them with one jax.lax.scan (faster compiles).")
  remat: Literal["none", "full", "save_dots", "save_named", "offload_named"] = key(
      "none", "Per-block rematerialization: none; full; save_dots (keep projection matmuls); save_named "
      "(keep q/k/v, attention output, MLP hidden); offload_named (those to pinned host memory).")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = key(20, "Length of the LR schedule, and the run's length unless --steps stops it sooner or later.", min=1)
  batch_size: int = key(16, "Global sequences per optimizer step (all microbatches, all ranks).", min=1)
  seq_len: int = key(128, "Tokens per sequence.", min=2)
  microbatches: int = key(1, "Gradient-accumulation steps per optimizer step; divides batch_size.", min=1)
  lr: float = key(3e-3, "Peak learning rate.", min=0.0)
  warmup_steps: int = key(5, "Linear warmup steps, from lr/warmup_steps up to lr.", min=0)
  min_lr_ratio: float = key(0.1, "Cosine decay ends at lr * min_lr_ratio at the last step.", min=0.0)
  weight_decay: float = key(0.1, "AdamW decoupled weight decay; applied to projection matrices only.", min=0.0)
  b1: float = key(0.9, "Adam beta1.", min=0.0)
  b2: float = key(0.95, "Adam beta2.", min=0.0)
  eps: float = key(1e-8, "Adam epsilon.", min=0.0)
  grad_clip: float = key(1.0, "Clip the global gradient norm to this value (0 disables).", min=0.0)
  seed: int = key(0, "Seed of the parameter init and of the data order.", min=0)
  max_skipped_in_a_row: int = key(10, "Abort the run after this many non-finite (skipped) steps in a row.", min=1)
  log_every: int = key(1, "Print a progress line every N steps (metrics.jsonl gets every step).", min=1)
  eval_interval: int = key(0, "Evaluate on the held-out split every N steps (0 = never); see data.eval_*.", min=0)
  sequence_parallel: bool = key(
      False, "Megatron sequence parallelism: with tensor > 1, norms and residual adds run split along the sequence.")
  xla_flags: Literal["none", "gpu-default"] = key(
      "none", "XLA/NCCL flag preset applied before the backend starts (jaxtrain.xla_flags); unknown flags are dropped.")
  xla_flags_extra: str = key("", "Extra XLA flags, space-separated (--xla_...=v), validated like the preset.")
  tensorboard: bool = key(True, "Also write the metrics as TensorBoard scalars to <workdir>/tb/ (process 0).")
  profile_steps: str = key("", "Steps to trace with jax.profiler into <workdir>/profile/, e.g. '5-7' or '3'; empty = none.")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  schedule: Literal["gpipe", "1f1b", "interleaved", "looped-bfs"] = key(
      "1f1b", "Pipeline schedule when the mesh has pipeline > 1 (microbatches = train.microbatches): gpipe; "
      "1f1b (stashes at most `stages` microbatches); interleaved (1f1b over virtual_stages chunks per device, "
      "bubble / virtual_stages); looped-bfs (breadth-first over the chunks).")
  virtual_stages: int = key(1, "Model chunks per pipeline device: >= 2 for interleaved and looped-bfs, else 1.", min=1)


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
  mode: Literal["auto", "dynamic", "off"] = key(
      "auto", "Dynamic loss scaling: auto = on for float16 compute only; dynamic = always; off = scale 1.0.")
  initial: float = key(2.0**15, "Initial loss scale.", min=1.0)
  growth_interval: int = key(2000, "Finite steps in a row after which the scale grows.", min=1)
  growth_factor: float = key(2.0, "Multiplier applied when the scale grows.", min=1.0)
  backoff_factor: float = key(0.5, "Multiplier applied after a non-finite step (< 1).", min=0.0)
  min: float = key(1.0, "Lower bound of the scale.", min=0.0)
  max: float = key(2.0**24, "Upper bound of the scale.", min=1.0)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  interval: int = key(10, "Save every N steps (and always at the last step and on SIGTERM); 0 = only those.", min=0)
  keep: int = key(3, "Committed checkpoints to keep (the newest ones).", min=1)
  keep_every: int = key(0, "Also keep every checkpoint whose step is a multiple of this (0 = none).", min=0)
  async_save: bool = key(True, "Write checkpoints in the background while training continues.")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  heartbeat_timeout_s: int = key(100, "A process silent this long counts as dead; the others then exit non-zero.", min=1)
  init_timeout_s: int = key(300, "How long processes wait for each other at start-up.", min=1)


@dataclasses.dataclass(frozen=True)
class DataConfig:
  source: str = key("bundled", "'bundled' (shipped corpus), a prepared dir, or a .txt/.jsonl/.parquet file; "
                    "comma-separated prepared dirs make a mixture.")
  text_field: str = key("text", "Field holding the text in a raw .jsonl/.parquet source.")
  tokenizer: str = key("byte", "'byte' or a path to a tokenizer.json; must be the one the data was prepared with.")
  weights: str = key("", "Mixture weights, comma-separated, one per source; empty = proportional to tokens.")
  eval_source: str = key("", "Held-out data (same forms as source); empty = hold out data.eval_fraction.")
  eval_fraction: float = key(0.0, "Fraction of each source's documents held out for evaluation (fixed split).", min=0.0)
  eval_batches: int = key(4, "Global batches per evaluation (the same ones every time).", min=1)
  workers: int = key(2, "Background threads building batches (0 = in the training thread).", min=0)
  prefetch: int = key(4, "Batches built ahead of the training loop.", min=1)
  verify: bool = key(True, "Check every shard's sha256 against the manifest when a prepared dir is opened.")


@dataclasses.dataclass(frozen=True)
class Config:
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  loss_scale: LossScaleConfig = dataclasses.field(default_factory=LossScaleConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)

  def to_dict(self) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(self)

  def digest(self, section: str) -> str:
    """A stable hash of one section, for checkpoint compatibility checks."""
    blob = json.dumps(dataclasses.asdict(getattr(self, section)), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(Config)}


def _fields(section: str) -> dict[str, dataclasses.Field]:
  return {f.name: f for f in dataclasses.fields(SECTIONS[section])}


def _type_name(tp: Any) -> str:
  if get_origin(tp) is Literal:
    return "one of " + ", ".join(map(str, get_args(tp)))
  return tp.__name__


def _coerce(where: str, tp: Any, value: Any, *, from_text: bool) -> Any:
  """Checks (and for CLI text, parses) `value` against the field type `tp`."""
  if get_origin(tp) is Literal:
    choices = get_args(tp)
    if value not in choices:
      raise UserError(f"{where}={value!r} is not allowed; choose one of: {', '.join(choices)}")
    return value
  if tp is bool:
    if from_text and isinstance(value, str) and value.lower() in ("true", "false"):
      return value.lower() == "true"
    if isinstance(value, bool):
      return value
    raise UserError(f"{where}={value!r} is not a bool; use true or false")
  if tp is int:
    if from_text and isinstance(value, str):
      try:
        value = int(value.replace("_", ""))
      except ValueError:
        raise UserError(f"{where}={value!r} is not an integer") from None
    if isinstance(value, bool) or not isinstance(value, int):
      raise UserError(f"{where}={value!r} is not an integer")
    return value
  if tp is float:
    if from_text and isinstance(value, str):
      try:
        value = float(value)
      except ValueError:
        raise UserError(f"{where}={value!r} is not a number") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise UserError(f"{where}={value!r} is not a number")
    return float(value)
  if tp is str:
    if not isinstance(value, str):
      raise UserError(f"{where}={value!r} is not a string")
    return value
  raise TypeError(f"unsupported config type {tp}")


def _set(raw: dict[str, dict[str, Any]], dotted: str, value: Any, *, from_text: bool) -> None:
  section, _, name = dotted.partition(".")
  if section not in SECTIONS:
    raise UserError(f"unknown config section {section!r} in {dotted!r}; sections: {', '.join(SECTIONS)}")
  fields = _fields(section)
  if name not in fields:
    raise UserError(f"unknown config key {dotted!r}; keys of [{section}]: {', '.join(fields)}")
  field = fields[name]
  tp = typing.get_type_hints(SECTIONS[section])[name]
  value = _coerce(dotted, tp, value, from_text=from_text)
  lo = field.metadata["min"]
  if lo is not None and value < lo:
    raise UserError(f"{dotted}={value} is below its minimum {lo}")
  raw.setdefault(section, {})[name] = value


def preset_names() -> list[str]:
  return sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))


def resolve_preset(name_or_path: str) -> Path:
  path = Path(name_or_path)
  if path.suffix == ".toml" or path.exists():
    if not path.is_file():
      raise UserError(f"config file {name_or_path!r} does not exist")
    return path
  path = CONFIG_DIR / f"{name_or_path}.toml"
  if not path.is_file():
    raise UserError(f"unknown config {name_or_path!r}; presets: {', '.join(preset_names())} (or a path to a .toml file)")
  return path


def load(name_or_path: str = "tiny", overrides: list[str] = ()) -> Config:
  """Builds a Config from a preset (name in configs/ or a path) plus `section.key=value` overrides."""
  path = resolve_preset(name_or_path)
  try:
    doc = tomllib.loads(path.read_text())
  except tomllib.TOMLDecodeError as e:
    raise UserError(f"config file {str(path)!r} is not valid TOML: {e}") from None
  raw: dict[str, dict[str, Any]] = {}
  for section, table in doc.items():
    if not isinstance(table, dict):
      raise UserError(f"{path.name}: top-level key {section!r} must be a [section]; sections: {', '.join(SECTIONS)}")
    for name, value in table.items():
      _set(raw, f"{section}.{name}", value, from_text=False)
  for item in overrides:
    dotted, eq, value = item.partition("=")
    if not eq or "." not in dotted:
      raise UserError(f"--set {item!r} must look like section.key=value")
    _set(raw, dotted.strip(), value.strip(), from_text=True)
  cfg = Config(**{s: SECTIONS[s](**raw.get(s, {})) for s in SECTIONS})
  validate(cfg)
  return cfg


def validate(cfg: Config) -> None:
  """Cross-key checks that do not depend on the mesh."""
  m, t = cfg.model, cfg.train
  if m.n_heads % m.n_kv_heads:
    raise UserError(f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads}")
  if m.moe_experts and m.moe_top_k > m.moe_experts:
    raise UserError(f"model.moe_top_k={m.moe_top_k} must be at most model.moe_experts={m.moe_experts}")
  if m.scan_layers and m.moe_experts and m.moe_every > 1:
    raise UserError(f"model.scan_layers=true needs identical layers; model.moe_every={m.moe_every} mixes dense and MoE "
                    "layers (use moe_every=1 or scan_layers=false)")
  if m.head_dim % 2:
    raise UserError(f"model.head_dim={m.head_dim} must be even (RoPE rotates pairs)")
  ls = cfg.loss_scale
  if not 0 < ls.backoff_factor < 1:
    raise UserError(f"loss_scale.backoff_factor={ls.backoff_factor} must be between 0 and 1 (exclusive)")
  if not ls.min <= ls.initial <= ls.max:
    raise UserError(f"loss_scale.initial={ls.initial} must lie within [loss_scale.min={ls.min}, loss_scale.max={ls.max}]")
  if t.batch_size % t.microbatches:
    raise UserError(f"train.microbatches={t.microbatches} must divide train.batch_size={t.batch_size}")


def help_text() -> str:
  """Every key with its type, default and meaning."""
  lines = []
  for section, cls in SECTIONS.items():
    lines.append(f"[{section}]")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
      lines.append(f"  {section}.{f.name} ({_type_name(hints[f.name])}, default {f.default!r})")
      lines.append(f"      {f.metadata['doc']}")
  return "\n".join(lines)
