"""Hugging Face checkpoints in and out (`python -m jaxtrain.hf import|export`).

Import reads a local Llama-family (llama, mistral without sliding window) or Mixtral
checkpoint (config.json, *.safetensors with or without an index, tokenizer.json), writes
W/<name>.toml and a committed step-0 checkpoint that `jaxtrain.train --workdir W --config
W/<name>.toml` resumes from. Every tensor is checked against config.json from the file
headers before anything is written; then each one is read alone (memory-mapped) and
placed straight onto its parameter's sharding, so host memory stays near one tensor.

Export writes config.json, model-0000x-of-0000y.safetensors with their index and the
run's tokenizer in the layout and names `transformers` loads. Each file is gathered to host
memory and written (safetensors.numpy) before the next: host memory stays near one file.

Layouts: HF stores a projection as (out, in); jaxtrain as (in, out) with heads split,
e.g. q_proj (H*E, D) <-> wq (D, H, E). Both rotate RoPE halves, so q/k need no permutation.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from jaxtrain.core.errors import UserError

SUPPORTED = ("llama", "mistral", "mixtral")
INDEX = "model.safetensors.index.json"
HF_KEPT = ("config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json")
# Non-weights some checkpoints carry; they are recomputed, never read.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
DTYPES = {"float32": ("F32", np.float32), "bfloat16": ("BF16", "bfloat16"), "float16": ("F16", np.float16)}
READABLE = ("F32", "BF16", "F16")


def _safetensors():
  try:
    import safetensors
  except ImportError:
    raise UserError("Hugging Face import/export needs the 'safetensors' package: pip install safetensors") from None
  return safetensors


# -- config.json <-> model.* keys -----------------------------------------------------------


def _rope(hf: dict) -> dict:
  """The rope settings of an HF config, old (rope_theta + rope_scaling) or new (rope_parameters) form."""
  params = dict(hf.get("rope_parameters") or {})
  if not params:
    params = dict(hf.get("rope_scaling") or {})
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
  params.setdefault("rope_type", params.pop("type", "default"))
  return params


def model_keys(hf: dict, where: str) -> dict[str, Any]:
  """config.json -> jaxtrain model.* keys; a UserError naming the first field we cannot represent."""
  mt = hf.get("model_type")
  if mt not in SUPPORTED:
    raise UserError(f"{where}: model_type={mt!r} is not supported; supported: {', '.join(SUPPORTED)}")

  def need(field, ok, allowed):
    if field in hf and hf[field] is not None and not ok(hf[field]):
      raise UserError(f"{where}: {field}={hf[field]!r} is not supported; allowed: {allowed}")

  need("hidden_act", lambda v: v == "silu", "silu")
  need("attention_bias", lambda v: v is False, "false")
  need("mlp_bias", lambda v: v is False, "false")
  need("sliding_window", lambda v: False, "null (no sliding window)")
  need("attn_logit_softcapping", lambda v: False, "null")
  for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
    if not isinstance(hf.get(field), int):
      raise UserError(f"{where}: {field} is missing or not an integer")
  D, H = hf["hidden_size"], hf["num_attention_heads"]
  rope = _rope(hf)
  keys: dict[str, Any] = {
      "vocab_size": hf["vocab_size"], "d_model": D, "n_layers": hf["num_hidden_layers"], "n_heads": H,
      "n_kv_heads": hf.get("num_key_value_heads") or H, "head_dim": hf.get("head_dim") or D // H,
      "d_ff": hf["intermediate_size"], "rope_theta": float(rope["rope_theta"]),
      "norm_eps": float(hf.get("rms_norm_eps", 1e-6)), "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
  }
  if rope["rope_type"] == "llama3":
    keys.update(rope_scaling="llama3", rope_factor=float(rope["factor"]),
                rope_low_freq_factor=float(rope["low_freq_factor"]),
                rope_high_freq_factor=float(rope["high_freq_factor"]),
                rope_original_max_position=int(rope["original_max_position_embeddings"]))
  elif rope["rope_type"] != "default":
    raise UserError(f"{where}: rope type {rope['rope_type']!r} is not supported; allowed: default, llama3")
  if mt == "mixtral":
    # HF Mixtral never drops tokens: dropless grouped matmuls (capacity factor 0 would be the
    # same function); its router_aux_loss_coef means the same under the hf aux convention.
    keys.update(moe_experts=hf.get("num_local_experts", 8), moe_top_k=hf.get("num_experts_per_tok", 2), moe_every=1,
                moe_capacity_factor=0.0, moe_dropless=True, moe_aux_convention="hf",
                moe_aux_weight=float(hf.get("router_aux_loss_coef", 0.001)), moe_z_weight=0.0)
  return keys


def hf_config(cfg, base: dict, dtype: str, tokenizer=None) -> dict:
  """The config.json of an exported run; fields of `base` (the imported config.json) that
  jaxtrain does not model (token ids, max positions) are kept."""
  m = cfg.model
  moe = m.moe_experts > 0
  if moe and m.moe_every != 1:
    raise UserError(f"model.moe_every={m.moe_every}: a Mixtral checkpoint has MoE in every layer; only 1 exports")
  extra = {"moe_shared_experts": 0, "moe_first_dense": 0, "moe_router": "softmax", "moe_bias_rate": 0.0}
  for k, plain in extra.items():
    if moe and getattr(m, k) != plain:
      raise UserError(f"model.{k}={getattr(m, k)!r}: Mixtral has no such layers; only {plain!r} exports")
  if moe and m.moe_expert_d_ff not in (0, m.d_ff):
    raise UserError(f"model.moe_expert_d_ff={m.moe_expert_d_ff}: Mixtral experts are d_ff={m.d_ff} wide; only 0 or "
                    f"{m.d_ff} exports")
  drop = ("rope_parameters", "rope_scaling", "rope_theta", "torch_dtype", "dtype", "architectures", "model_type",
          "transformers_version", "sliding_window")
  out = {k: v for k, v in base.items() if k not in drop}
  out.update(
      architectures=["MixtralForCausalLM" if moe else "LlamaForCausalLM"], model_type="mixtral" if moe else "llama",
      vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.d_ff, num_hidden_layers=m.n_layers,
      num_attention_heads=m.n_heads, num_key_value_heads=m.n_kv_heads, head_dim=m.head_dim, hidden_act="silu",
      rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta, tie_word_embeddings=m.tie_embeddings, torch_dtype=dtype,
      rope_scaling=None if m.rope_scaling == "none" else {
          "rope_type": "llama3", "factor": m.rope_factor, "low_freq_factor": m.rope_low_freq_factor,
          "high_freq_factor": m.rope_high_freq_factor,
          "original_max_position_embeddings": m.rope_original_max_position})
  if m.rope_scaling == "llama3":
    out.setdefault("max_position_embeddings", int(m.rope_original_max_position * m.rope_factor))
  out.setdefault("max_position_embeddings", max(8192, cfg.train.seq_len))
  if moe:
    out.update(num_local_experts=m.moe_experts, num_experts_per_tok=m.moe_top_k, sliding_window=None,
               router_aux_loss_coef=m.moe_aux_weight, output_router_logits=False)
  else:
    out.update(attention_bias=False, mlp_bias=False)
  if tokenizer is not None:
    out.setdefault("eos_token_id", tokenizer.eos_id)
    if tokenizer.bos_id is not None:
      out.setdefault("bos_token_id", tokenizer.bos_id)
  return out


# -- the tensor table ----------------------------------------------------------------------------


@dataclasses.dataclass
class Tensor:
  """One jaxtrain parameter and the HF tensors it is made of. `names` has the parameter's
  leading stacked dimensions (scanned layers, experts) as its shape; each HF tensor maps to
  the trailing dimensions through `to_ours` / `to_hf`."""
  path: tuple
  names: np.ndarray  # object array of HF names, shape = stacked dims
  hf_shape: tuple[int, ...]
  to_ours: Callable[[np.ndarray], np.ndarray]
  to_hf: Callable[[np.ndarray], np.ndarray]


def _same(a):
  return a


def _t(a):
  return a.T


def _block(cfg, moe_layer: bool) -> list[tuple]:
  """(path inside a block, HF suffix or expert-indexed suffix, HF shape, to_ours, to_hf)."""
  D, H, K, E, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
  rows = [
      (("attn", "wq"), "self_attn.q_proj.weight", (H * E, D),
       lambda w: w.T.reshape(D, H, E), lambda a: a.reshape(D, H * E).T),
      (("attn", "wk"), "self_attn.k_proj.weight", (K * E, D),
       lambda w: w.T.reshape(D, K, E), lambda a: a.reshape(D, K * E).T),
      (("attn", "wv"), "self_attn.v_proj.weight", (K * E, D),
       lambda w: w.T.reshape(D, K, E), lambda a: a.reshape(D, K * E).T),
      (("attn", "wo"), "self_attn.o_proj.weight", (D, H * E),
       lambda w: w.T.reshape(H, E, D), lambda a: a.reshape(H * E, D).T),
      (("attn_norm", "scale"), "input_layernorm.weight", (D,), _same, _same),
      (("mlp_norm", "scale"), "post_attention_layernorm.weight", (D,), _same, _same),
  ]
  if moe_layer:
    X = cfg.moe_experts
    rows += [
        (("mlp", "router"), "block_sparse_moe.gate.weight", (X, D), _t, _t),
        (("mlp", "w_gate"), [f"block_sparse_moe.experts.{x}.w1.weight" for x in range(X)], (F, D), _t, _t),
        (("mlp", "w_up"), [f"block_sparse_moe.experts.{x}.w3.weight" for x in range(X)], (F, D), _t, _t),
        (("mlp", "w_down"), [f"block_sparse_moe.experts.{x}.w2.weight" for x in range(X)], (D, F), _t, _t),
    ]
  else:
    rows += [
        (("mlp", "w_gate"), "mlp.gate_proj.weight", (F, D), _t, _t),
        (("mlp", "w_up"), "mlp.up_proj.weight", (F, D), _t, _t),
        (("mlp", "w_down"), "mlp.down_proj.weight", (D, F), _t, _t),
    ]
  return rows


def _names(suffix, layers: list[int]) -> np.ndarray:
  """HF names with shape (len(layers),)[:scanned] + (experts,)[:per-expert]."""
  per_layer = [[f"model.layers.{i}.{s}" for s in suffix] if isinstance(suffix, list) else f"model.layers.{i}.{suffix}"
               for i in layers]
  out = np.empty((len(layers),) + ((len(suffix),) if isinstance(suffix, list) else ()), dtype=object)
  for i, v in enumerate(per_layer):
    out[i] = v if not isinstance(v, list) else np.array(v, dtype=object)
  return out


def table(cfg) -> list[Tensor]:
  """Every jaxtrain parameter of `cfg` (a ModelConfig) with its HF tensors."""
  scalar = lambda n: np.array(n, dtype=object)  # noqa: E731
  out = [Tensor(("embed",), scalar("model.embed_tokens.weight"), (cfg.vocab_size, cfg.d_model), _same, _same)]
  L = cfg.n_layers
  if cfg.scan_layers:  # every layer alike (validated): one stacked parameter per block parameter
    for path, suffix, shape, to_ours, to_hf in _block(cfg, cfg.is_moe_layer(0)):
      out.append(Tensor(("layers", *path), _names(suffix, list(range(L))), shape, to_ours, to_hf))
  else:
    for i in range(L):
      for path, suffix, shape, to_ours, to_hf in _block(cfg, cfg.is_moe_layer(i)):
        out.append(Tensor(("layers", i, *path), np.asarray(_names(suffix, [i])[0], dtype=object), shape,
                          to_ours, to_hf))
  out.append(Tensor(("final_norm", "scale"), scalar("model.norm.weight"), (cfg.d_model,), _same, _same))
  if not cfg.tie_embeddings:
    out.append(Tensor(("lm_head",), scalar("lm_head.weight"), (cfg.vocab_size, cfg.d_model), _t, _t))
  return out


def _flat(names: np.ndarray):
  return [names[()]] if names.ndim == 0 else list(names.flat)


# -- reading -------------------------------------------------------------------------------------


def read_config(hf_dir: Path) -> dict:
  path = hf_dir / "config.json"
  if not hf_dir.is_dir():
    raise UserError(f"{hf_dir} is not a directory (expected a Hugging Face checkpoint directory)")
  try:
    return json.loads(path.read_text())
  except FileNotFoundError:
    raise UserError(f"{hf_dir}: config.json is missing") from None
  except json.JSONDecodeError as e:
    raise UserError(f"{path}: not valid JSON ({e})") from None


def read_headers(hf_dir: Path) -> dict[str, tuple[Path, tuple[int, ...], str]]:
  """{tensor name: (file, shape, dtype)} from the safetensors headers (no tensor data read)."""
  safetensors = _safetensors()
  index = hf_dir / INDEX
  if index.is_file():
    try:
      files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (json.JSONDecodeError, KeyError, AttributeError) as e:
      raise UserError(f"{index}: not a valid safetensors index ({e})") from None
    for f in files:
      if not (hf_dir / f).is_file():
        raise UserError(f"{hf_dir}: shard {f} is missing ({INDEX} names it)")
  else:
    files = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    if not files:
      raise UserError(f"{hf_dir}: no *.safetensors file (only safetensors weights are read)")
  out = {}
  for f in files:
    try:
      with safetensors.safe_open(str(hf_dir / f), framework="numpy") as st:
        for name in st.keys():
          sl = st.get_slice(name)
          out[name] = (hf_dir / f, tuple(sl.get_shape()), sl.get_dtype())
    except Exception as e:  # noqa: BLE001 (safetensors raises its own error types for damaged files)
      raise UserError(f"{hf_dir / f}: not a readable safetensors file ({str(e).splitlines()[0]})") from None
  return out


def check_tensors(tensors: list[Tensor], headers: dict, hf_dir: Path, tied: bool) -> None:
  """Every tensor present with the shape config.json implies; nothing we would silently drop."""
  want = {}
  for t in tensors:
    for n in _flat(t.names):
      want[n] = t.hf_shape
  for name, shape in want.items():
    if name not in headers:
      raise UserError(f"{hf_dir}: tensor {name} is missing")
    got, dtype = headers[name][1], headers[name][2]
    if got != shape:
      raise UserError(f"{hf_dir}: tensor {name} has shape {list(got)}, config.json implies {list(shape)}")
    if dtype not in READABLE:
      raise UserError(f"{hf_dir}: tensor {name} has dtype {dtype}; readable: {', '.join(READABLE)}")
  for name in headers:
    if name in want or name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
      continue
    what = "biases are not supported" if name.endswith(".bias") else "not part of a model jaxtrain represents"
    raise UserError(f"{hf_dir}: unexpected tensor {name} ({what})")


class Reader:
  """Reads one HF tensor at a time as float32 in jaxtrain's layout. The file is opened per
  tensor, so no mapping outlives the read; the last tensor is kept because each device's
  shard of it is cut from the same array."""

  def __init__(self, headers: dict):
    self.headers, self._last = headers, (None, None)
    self.bytes_read = 0

  def get(self, name: str, to_ours) -> np.ndarray:
    if self._last[0] == name:
      return self._last[1]
    self._last = (None, None)  # free the previous one before reading the next
    safetensors = _safetensors()
    with safetensors.safe_open(str(self.headers[name][0]), framework="numpy") as st:
      raw = st.get_tensor(name)
    self.bytes_read += raw.nbytes
    arr = np.ascontiguousarray(to_ours(raw.astype(np.float32)))
    del raw
    self._last = (name, arr)
    return arr

  def shard(self, t: Tensor, index: tuple) -> np.ndarray:
    """The part `index` (slices over the jaxtrain shape) of parameter `t`."""
    ns = t.names.ndim
    sub = np.asarray(t.names[index[:ns]], dtype=object)
    blocks = [self.get(n, t.to_ours)[index[ns:]] for n in _flat(sub)]
    return np.stack(blocks).reshape(sub.shape + blocks[0].shape) if ns else blocks[0]


# -- writing config TOML -------------------------------------------------------------------------


def _toml_value(v) -> str:
  if isinstance(v, bool):
    return "true" if v else "false"
  if isinstance(v, (int, float)):
    return repr(v)
  return json.dumps(v)


def toml_text(sections: dict[str, dict], header: str) -> str:
  lines = [f"# {header}"]
  for section, table_ in sections.items():
    if table_:
      lines += ["", f"[{section}]"] + [f"{k} = {_toml_value(v)}" for k, v in table_.items()]
  return "\n".join(lines) + "\n"


# -- import --------------------------------------------------------------------------------------


@dataclasses.dataclass
class ImportPlan:
  """Everything checked before a device starts: the config and where each tensor lies."""
  hf_dir: Path
  workdir: Path
  name: str
  cfg: Any
  toml: str
  headers: dict
  tokenizer: Path | None


def plan_import(hf_dir: str, workdir: str, overrides: list[str], name: str | None = None) -> ImportPlan:
  from jaxtrain.run import checkpoint
  from jaxtrain.core import config
  src, w = Path(hf_dir), Path(workdir)
  hf = read_config(src)
  keys = model_keys(hf, str(src / "config.json"))
  tok = src / "tokenizer.json"
  w_abs = w.absolute()
  sections = {"model": keys, "optim": {"lr": 1e-5, "warmup_steps": 10},
              "data": {"tokenizer": str(w_abs / "tokenizer.json") if tok.is_file() else "byte"}}
  with tempfile.TemporaryDirectory() as tmp:
    path = Path(tmp) / "imported.toml"
    path.write_text(toml_text(sections, ""))
    cfg = config.load(str(path), overrides)
  for item in overrides:  # the written config records the overrides too
    dotted = item.partition("=")[0].strip()
    section, _, key_ = config.RENAMED.get(dotted, dotted).partition(".")
    sections.setdefault(section, {})[key_] = getattr(getattr(cfg, section), key_)
  sections["model"] = dataclasses.asdict(cfg.model)  # every model key explicit
  headers = read_headers(src)
  check_tensors(table(cfg.model), headers, src, cfg.model.tie_embeddings)
  if checkpoint.committed_steps(w / "checkpoints"):
    raise UserError(f"--workdir {w} already holds checkpoints; import into a new directory")
  name = name or src.absolute().name
  text = toml_text(sections, f"Imported by `python -m jaxtrain.hf import {src}`: {hf['model_type']}, "
                             f"{', '.join(hf.get('architectures') or [])}.")
  return ImportPlan(src, w, name, cfg, text, headers, tok if tok.is_file() else None)


def run_import(plan: ImportPlan, mesh) -> Path:
  """Places every tensor onto its sharding and commits a step-0 checkpoint; returns the config path."""
  import jax
  from jaxtrain import data
  from jaxtrain.run import checkpoint
  from jaxtrain.parallel import mesh as mesh_lib
  from jaxtrain.run import progress
  from jaxtrain.run import step as step_lib
  t0 = time.perf_counter()
  cfg, w = plan.cfg, plan.workdir
  is_writer = jax.process_index() == 0
  if is_writer:
    (w / "hf").mkdir(parents=True, exist_ok=True)
    for f in HF_KEPT:  # kept for export: token ids and fields jaxtrain does not model
      if (plan.hf_dir / f).is_file():
        shutil.copyfile(plan.hf_dir / f, w / "hf" / f)
    if plan.tokenizer is not None:
      shutil.copyfile(plan.tokenizer, w / "tokenizer.json")
    (w / f"{plan.name}.toml").write_text(plan.toml)
  setup = step_lib.Setup(cfg, mesh)
  shapes = jax.eval_shape(setup.init)["params"]
  shardings = setup.state_shardings["params"]
  by_path = {t.path: t for t in table(cfg.model)}
  reader = Reader(plan.headers)

  def place(path, shape, sh):
    t = by_path[tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)]
    return jax.make_array_from_callback(shape.shape, sh, lambda index: reader.shard(t, index))

  params = jax.tree_util.tree_map_with_path(place, shapes, shardings)
  reader._last = (None, None)  # noqa: SLF001
  # Adam moments start at zero, the schedule at step 0; donation reuses the params' buffers.
  state = jax.jit(lambda p: step_lib.init_state(cfg, setup.opt, p), out_shardings=setup.state_shardings,
                  donate_argnums=0)(params)
  del params
  ck = cfg.checkpoint
  ckpts = checkpoint.Checkpoints(w / "checkpoints", ck.keep, ck.keep_every, async_save=False, is_writer=is_writer,
                                 verify=ck.verify)
  body = {"progress": vars(progress.Progress()), "data_state": {"version": 1, "step": 0},
          "mesh": mesh_lib.describe(dict(mesh.shape)), "fingerprint": import_fingerprint(cfg, data.tokenizer_digest(cfg)),
          "config": cfg.to_dict(), "seed": cfg.train.seed, "process_count": jax.process_count(),
          "imported_from": {"dir": str(plan.hf_dir.absolute()), "tensors": len(plan.headers)}}
  try:
    ckpts.save(0, state, body)
  finally:
    ckpts.close()
  print(f"imported {len(plan.headers)} tensors ({reader.bytes_read / 2**30:.2f} GiB read) from {plan.hf_dir} in "
        f"{time.perf_counter() - t0:.1f}s: {setup.n_params:,} params, step-0 checkpoint in {w / 'checkpoints' / '0'}")
  return w / f"{plan.name}.toml"


def import_fingerprint(cfg, tokenizer_digest: str) -> dict:
  """A step-0 import has taken no step and read no data: the next run may pick any train
  settings and data (checkpoint.ANY); the model and the tokenizer must stay."""
  from jaxtrain.run import checkpoint
  fp = checkpoint.fingerprint(cfg, tokenizer_digest, "")
  return {**fp, "train": checkpoint.ANY, "data": checkpoint.ANY}


# -- export --------------------------------------------------------------------------------------


def _plan_files(items: list[tuple[str, tuple, int]], max_bytes: int) -> list[list[tuple[str, tuple, int]]]:
  files, cur, size = [], [], 0
  for it in items:
    if cur and size + it[2] > max_bytes:
      files.append(cur)
      cur, size = [], 0
    cur.append(it)
    size += it[2]
  return files + ([cur] if cur else [])


def run_export(cfg, mesh, step_dir: Path, out: Path, dtype: str, max_shard_bytes: int, workdir: Path) -> None:
  import jax
  from jax.experimental import multihost_utils
  from jaxtrain.run import runs
  from jaxtrain.data import tokenizer as tokenizer_lib
  t0 = time.perf_counter()
  _, np_dtype = DTYPES[dtype]  # the file dtype tag follows from the numpy dtype (safetensors)
  if np_dtype == "bfloat16":
    import ml_dtypes
    np_dtype = ml_dtypes.bfloat16
  itemsize = np.dtype(np_dtype).itemsize
  _, params = runs.restore_params(cfg, mesh, step_dir)
  tensors = table(cfg.model)
  items, where = [], {}
  for t in tensors:
    for s in np.ndindex(t.names.shape):
      name = t.names[s]
      items.append((name, t.hf_shape, math.prod(t.hf_shape) * itemsize))
      where[name] = (t, s)
  files = _plan_files(items, max_shard_bytes)
  n, me, procs = len(files), jax.process_index(), jax.process_count()
  fname = lambda i: f"model-{i + 1:05d}-of-{n:05d}.safetensors"  # noqa: E731
  out.mkdir(parents=True, exist_ok=True)

  def leaf(path):
    x = params
    for k in path:
      x = x[k]
    return x

  def host_value(name):
    t, s = where[name]
    x = leaf(t.path)
    x = x[s] if s else x
    # One tensor at a time: local when this process holds it whole, else gathered once.
    x = np.asarray(x) if x.is_fully_addressable else multihost_utils.process_allgather(x, tiled=True)
    return np.ascontiguousarray(t.to_hf(np.asarray(x, np.float32)).astype(np_dtype))

  _safetensors()
  from safetensors.numpy import save_file
  for i, entries in enumerate(files):
    mine = i % procs == me  # files are spread over the processes
    shard = {}  # host memory: one file's tensors at a time
    for name, shape, nbytes in entries:
      arr = host_value(name)  # every process takes part: a gather is a collective
      assert arr.shape == shape and arr.nbytes == nbytes, (name, arr.shape, shape)
      if mine:
        shard[name] = arr
    if mine:
      save_file(shard, out / fname(i), metadata={"format": "pt"})
    del shard
  if me == 0:
    index = {"metadata": {"total_size": sum(it[2] for it in items)},
             "weight_map": {name: fname(i) for i, entries in enumerate(files) for name, _, _ in entries}}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    kept = workdir / "hf"
    base = json.loads((kept / "config.json").read_text()) if (kept / "config.json").is_file() else {}
    tok = None
    if cfg.data.tokenizer != "byte":
      tok = tokenizer_lib.load(cfg.data.tokenizer)
      shutil.copyfile(cfg.data.tokenizer, out / "tokenizer.json")
      for f in HF_KEPT[1:]:
        if (kept / f).is_file():
          shutil.copyfile(kept / f, out / f)
    (out / "config.json").write_text(json.dumps(hf_config(cfg, base, dtype, tok), indent=2) + "\n")
  print(f"exported step {step_dir.name} of {workdir} to {out}: {len(items)} tensors in {n} file(s), "
        f"{sum(it[2] for it in items) / 2**30:.2f} GiB {dtype}, in {time.perf_counter() - t0:.1f}s")


# -- CLI -----------------------------------------------------------------------------------------
