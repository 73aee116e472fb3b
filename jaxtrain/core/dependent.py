"""The one table of dependent keys (`DEPENDENT`): what acts only when another key or the mesh says so, what a
config sets that therefore changes nothing (`ignored`), and what the fingerprint leaves out (`inactive`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from jaxtrain.core.schema import Config, fields


@dataclasses.dataclass(frozen=True)
class Needs:
  """Keys that act only while a condition holds. Otherwise they change nothing: a value other than the default is
  reported once ("ignored: ...", `ignored`) and the keys are left out of the fingerprint (`inactive`), so that a
  resume without them is the same run. `holds(cfg, axes)`: `axes` the mesh's axis sizes (`mesh`: the condition
  reads them; undecided without a mesh)."""
  keys: tuple[str, ...]
  when: str
  holds: Callable[[Config, Mapping[str, int]], bool]
  mesh: bool = False


def _axis(name: str) -> Callable[[Config, Mapping[str, int]], bool]:
  return lambda c, axes: axes.get(name, 1) > 1


def _raw_source(c: Config) -> bool:
  """Whether a data source is a raw file with fields (.jsonl, .parquet; the bundled corpus is a .jsonl)."""
  specs = [s.strip() for s in f"{c.data.source},{c.data.eval_source}".split(",")]
  return any(s == "bundled" or s.endswith((".jsonl", ".parquet")) for s in specs)


# LoRA's keys: a parameters-only checkpoint (an import) gains fresh adapters, whatever its own were
LORA_KEYS = tuple(f"model.{k}" for k in fields("model") if k.startswith("lora_"))
_LOSS_SCALE = tuple(f"loss_scale.{k}" for k in fields("loss_scale") if k != "mode")
# The one table of dependent keys: what acts only when another key (or the mesh) says so.
DEPENDENT = (
    Needs(("model.lora_alpha", "model.lora_targets"), "model.lora_rank > 0", lambda c, _: c.model.lora_rank > 0),
    Needs(tuple(f"model.{k}" for k in fields("model") if k.startswith("moe_") and k != "moe_experts"),
          "model.moe_experts > 0", lambda c, _: c.model.moe_experts > 0),
    Needs(("model.moe_capacity_factor", "model.moe_group_size"), "model.moe_dropless=false",
          lambda c, _: not c.model.moe_dropless),
    Needs(("model.moe_grouped_matmul",), "model.moe_dropless=true", lambda c, _: c.model.moe_dropless),
    Needs(("model.moe_topk_group",), "model.moe_n_group > 1", lambda c, _: c.model.moe_n_group > 1),
    Needs(("model.q_lora_rank", "model.kv_lora_rank", "model.qk_nope_head_dim", "model.qk_rope_head_dim",
           "model.v_head_dim"), "model.attention_type=mla", lambda c, _: c.model.attention_type == "mla"),
    Needs(("model.rope_factor",), "model.rope_scaling=linear, llama3 or yarn",
          lambda c, _: c.model.rope_scaling != "none"),
    Needs(("model.rope_original_max_position",), "model.rope_scaling=llama3 or yarn",
          lambda c, _: c.model.rope_scaling in ("llama3", "yarn")),
    Needs(("model.rope_local_theta",), "model.sliding_window > 0", lambda c, _: c.model.sliding_window > 0),
    Needs(("model.rope_low_freq_factor", "model.rope_high_freq_factor"), "model.rope_scaling=llama3",
          lambda c, _: c.model.rope_scaling == "llama3"),
    Needs(("model.rope_beta_fast", "model.rope_beta_slow", "model.rope_mscale"), "model.rope_scaling=yarn",
          lambda c, _: c.model.rope_scaling == "yarn"),
    Needs(("model.rope_mscale_all_dim",), "model.rope_scaling=yarn, or llama3 with model.attention_type=mla",
          lambda c, _: c.model.rope_scaling == "yarn" or (c.model.rope_scaling == "llama3"
                                                          and c.model.attention_type == "mla")),
    Needs(("model.layer_types",), "model.sliding_window > 0", lambda c, _: c.model.sliding_window > 0),
    Needs(("train.dpo_beta",), "train.objective=dpo", lambda c, _: c.train.objective == "dpo"),
    Needs(("train.steps", "optim.warmup_steps"), "train.tokens=0 (the schedule in steps)",
          lambda c, _: not c.train.tokens),
    Needs(("optim.lr_batch_scaling",), "optim.lr_reference_batch > 0", lambda c, _: c.optim.lr_reference_batch > 0),
    Needs(_LOSS_SCALE, "loss scaling (loss_scale.mode=dynamic, or auto with model.dtype=float16)",
          lambda c, _: c.loss_scale.mode == "dynamic" or (c.loss_scale.mode == "auto" and c.model.dtype == "float16")),
    Needs(("data.eval_source", "data.eval_batches"), "train.eval_interval > 0", lambda c, _: c.train.eval_interval > 0),
    Needs(("train.eval_tasks", "train.eval_tasks_limit", "train.eval_include_path"), "train.eval_tasks_interval > 0",
          lambda c, _: c.train.eval_tasks_interval > 0),
    Needs(("data.weights",), "several data.source entries", lambda c, _: "," in c.data.source.strip(" ,")),
    Needs(("data.text_field",), "a raw .jsonl or .parquet data source (or bundled)", lambda c, _: _raw_source(c)),
    Needs(("run.xla_flags_unknown",), "run.xla_flags_extra", lambda c, _: bool(c.run.xla_flags_extra.strip())),
    Needs(("run.hang_first_step_s",), "run.hang_timeout_s != 0 or run.xla_flags=gpu-default",
          lambda c, _: c.run.hang_timeout_s != 0 or c.run.xla_flags == "gpu-default"),
    Needs(("pipeline.schedule", "pipeline.virtual_stages"), "a pipeline axis (mesh pipeline > 1)", _axis("pipeline"),
          mesh=True),
    Needs(("optim.zero_stage",), "a data axis (mesh data > 1)", _axis("data"), mesh=True),
    Needs(("run.sequence_parallel",), "a tensor axis (mesh tensor > 1)", _axis("tensor"), mesh=True),
    Needs(("model.sequence_attention",), "a sequence axis (mesh sequence > 1)", _axis("sequence"), mesh=True),
)


def value_of(cfg: Config, dotted: str) -> Any:
  section, _, name = dotted.partition(".")
  return getattr(getattr(cfg, section), name)


def inactive(cfg: Config, axes: Mapping[str, int] | None = None) -> dict[str, Needs]:
  """{key: the rule it waits for} for every key that changes nothing in `cfg` (on a mesh of `axes`; None: the
  mesh's rules undecided)."""
  return {k: n for n in DEPENDENT if not (n.mesh and axes is None) and not n.holds(cfg, axes or {}) for k in n.keys}


def ignored(cfg: Config, axes: Mapping[str, int] | None = None) -> list[str]:
  """One phrase per rule whose keys are set (not to their default) but act not: what the run ignores."""
  defaults, out = Config(), {}
  for k, n in inactive(cfg, axes).items():
    if value_of(cfg, k) != value_of(defaults, k):
      out.setdefault(n, []).append(f"{k}={value_of(cfg, k)!r}")
  return [f"{', '.join(keys)} (acts only with {n.when})" for n, keys in out.items()]
