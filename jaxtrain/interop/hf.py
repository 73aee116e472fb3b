"""Hugging Face checkpoints in (`python -m jaxtrain.hf import`); see docs/huggingface.md. The config.json mapping
is hf_keys.py, the tensor table import and export (hf_export.py) share is hf_table.py.

Import checks every tensor from the file headers before writing anything, then places one
tensor at a time onto its sharding."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxtrain.core import files
from jaxtrain.core.errors import UserError
from jaxtrain.interop import hf_deepseek, hf_gptoss, hf_source
from jaxtrain.interop.hf_keys import SUPPORTED, hf_config, model_keys  # noqa: F401 (hf.hf_config: the API callers use)
from jaxtrain.interop.hf_table import Tensor, table

INDEX = "model.safetensors.index.json"
HF_KEPT = ("config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json",
           "vocab.json", "merges.txt")  # the last two: Qwen3's slow-tokenizer files beside tokenizer.json
# non-weights some checkpoints carry (recomputed), and DeepSeek's MTP layer's copies of the shared embedding and head
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "embed_tokens.weight", "shared_head.head.weight")
DTYPES = {"float32": np.float32, "bfloat16": "bfloat16", "float16": np.float16}
READABLE = ("F32", "BF16", "F16", hf_gptoss.MXFP4)


def safetensors_api():
  try:
    import safetensors
  except ImportError:
    raise UserError("Hugging Face import/export needs the 'safetensors' package: pip install safetensors") from None
  return safetensors


# -- import --------------------------------------------------------------------------------------


def _hf_index(t: Tensor, index: tuple) -> tuple | None:
  """The HF (out, in) slices holding our part `index` of one tensor, or None if they are not contiguous ranges.
  Ours is the transpose (in, out) reshaped: each HF dimension is a run of our dimensions merged."""
  if t.rows is not None or t.fused is not None or (t.ours is not None and len(t.hf_shape) < 2):
    return None  # permuted rows, interleaved columns, a vector split into heads: read whole, then cut
  if t.ours is None:
    return index
  n_in, split = t.hf_shape[1], 0
  while math.prod(t.ours[:split]) < n_in:
    split += 1

  def merged(slices, sizes):
    start, count, partial = 0, 1, False
    for s, n in zip(slices, sizes):
      r = range(*s.indices(n))
      if partial and len(r) != n:  # a cut dimension inside a cut one: strided in the file
        return None
      start, count, partial = start * n + r.start, count * len(r), partial or len(r) > 1
    return slice(start, start + count)
  rows, cols = merged(index[split:], t.ours[split:]), merged(index[:split], t.ours[:split])
  return None if rows is None or cols is None else (rows, cols)


def read_headers(hf_dir: Path) -> dict[str, tuple[Path, tuple[int, ...], str]]:
  """{tensor name: (file, shape, dtype)} from the safetensors headers (no tensor data read)."""
  safetensors = safetensors_api()
  index = hf_dir / INDEX
  if index.is_file():
    try:
      files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as e:
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


def own_head(headers: dict) -> bool:
  """Whether the checkpoint's lm_head.weight is a head of its own: present and not equal to the embedding.
  transformers (5.x, PreTrainedModel.tie_weights) ties a tie_word_embeddings=true model's head to its embedding
  only where the checkpoint lacks the head or holds the same values; a different head is kept, untied."""
  if "lm_head.weight" not in headers or "model.embed_tokens.weight" not in headers:
    return False
  (fa, sa, _), (fb, sb, _) = headers["model.embed_tokens.weight"], headers["lm_head.weight"]
  if sa != sb or len(sa) != 2:
    return True
  safe_open = safetensors_api().safe_open
  rows = max(1, 2**24 // max(1, sa[1]))  # 64 MB of float32 per side at a time
  with safe_open(str(fa), framework="numpy") as a, safe_open(str(fb), framework="numpy") as b:
    ea, hb = a.get_slice("model.embed_tokens.weight"), b.get_slice("lm_head.weight")
    for r in range(0, sa[0], rows):  # compared as values (bfloat16 and float16 widen exactly), as torch.equal does
      part = slice(r, min(r + rows, sa[0]))  # safetensors does not clip a slice
      if not np.array_equal(ea[part].astype(np.float32), hb[part].astype(np.float32)):
        return True
  return False


def check_tensors(tensors: list[Tensor], headers: dict, hf_dir: Path, tied: bool, head: bool = False) -> None:
  """Every tensor present with the shape config.json implies; nothing we would silently drop (`head`: the
  checkpoint's lm_head.weight differs from its embedding, so a tied model would drop it)."""
  want = {n: t.hf_shape for t in tensors for n in t.names.flat}
  for name, shape in want.items():
    if name not in headers:
      raise UserError(f"{hf_dir}: tensor {name} is missing")
    _, got, dtype = headers[name]
    if got != shape:
      raise UserError(f"{hf_dir}: tensor {name} has shape {list(got)}, config.json implies {list(shape)}")
    if dtype not in READABLE:
      raise UserError(f"{hf_dir}: tensor {name} has dtype {dtype}; readable: {', '.join(READABLE)}")
  if tied and head:
    raise UserError(f"{hf_dir}: lm_head.weight differs from model.embed_tokens.weight; model.tie_embeddings=true "
                    "would drop it (leave tie_embeddings false: the head is imported as its own)")
  for name in headers:
    if name not in want and not name.endswith(IGNORED_SUFFIXES) and not (tied and name == "lm_head.weight"):
      what = "biases are not supported" if name.endswith(".bias") else "not part of a model jaxtrain represents"
      raise UserError(f"{hf_dir}: unexpected tensor {name} ({what})")


def toml_text(sections: dict[str, dict], header: str) -> str:
  def value(v):
    if isinstance(v, bool):
      return "true" if v else "false"
    return repr(v) if isinstance(v, (int, float)) else json.dumps(v)

  lines = [f"# {header}"]
  for section, keys in sections.items():
    if keys:
      lines += ["", f"[{section}]"] + [f"{k} = {value(v)}" for k, v in keys.items()]
  return "\n".join(lines) + "\n"


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
  from jaxtrain.core import config
  from jaxtrain.run import checkpoint
  src, w = Path(hf_dir), Path(workdir)
  if not src.is_dir():
    raise UserError(f"{src} is not a directory (expected a Hugging Face checkpoint directory)")
  try:
    hf = json.loads((src / "config.json").read_text())
  except FileNotFoundError:
    raise UserError(f"{src}: config.json is missing") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise UserError(f"{src / 'config.json'}: not valid JSON ({e})") from None
  except OSError as e:
    raise UserError(f"{src / 'config.json'}: cannot be read ({e})") from None
  if not isinstance(hf, dict):
    raise UserError(f"{src / 'config.json'}: must hold a JSON object of fields, not {type(hf).__name__}")
  tok = src / "tokenizer.json"
  headers = read_headers(src)
  model = model_keys(hf, str(src / "config.json"))
  if hf.get("model_type") == "deepseek_v3":
    model.update(hf_deepseek.mtp_keys(hf, headers))
  if hf.get("model_type") == "gpt_oss":  # MXFP4 experts: read dequantized
    headers = hf_gptoss.unpack_headers(headers)
  head = model["tie_embeddings"] and own_head(headers)
  if head:  # as transformers loads it: the checkpoint's own head, untied
    model["tie_embeddings"] = False
    print(f"note: {src / 'config.json'} has tie_word_embeddings=true but lm_head.weight differs from "
          "model.embed_tokens.weight: imported untied, with its own head (as transformers loads it)", file=sys.stderr)
  try:  # the model keys config.json implies, checked before any override
    config.from_dict({"model": model}, where=str(src / "config.json"))
  except UserError as e:
    raise UserError(f"{src / 'config.json'}: {e}") from None
  sections = {"model": model, "optim": {"lr": 1e-5, "warmup_steps": 10},
              "data": {"tokenizer": str(w.absolute() / "tokenizer.json") if tok.is_file() else "byte"}}
  with tempfile.TemporaryDirectory() as tmp:
    path = Path(tmp) / "imported.toml"
    path.write_text(toml_text(sections, ""))
    cfg = config.load(str(path), overrides)
  for item in overrides:  # the written config records the overrides too
    dotted = item.partition("=")[0].strip()
    dotted = config.SWITCHES[dotted][0] if dotted in config.SWITCHES else config.RENAMED.get(dotted, dotted)
    section, _, key = dotted.partition(".")  # an old switch (run.tensorboard) as the list it edits
    sections.setdefault(section, {})[key] = getattr(getattr(cfg, section), key)
  sections["model"] = dataclasses.asdict(cfg.model)  # every model key explicit
  head = head or (cfg.model.tie_embeddings and own_head(headers))  # --set model.tie_embeddings=true
  check_tensors(table(cfg.model), headers, src, cfg.model.tie_embeddings, head)
  if checkpoint.committed_steps(w / "checkpoints"):
    raise UserError(f"--workdir {w} already holds checkpoints; import into a new directory")
  name = name if name is not None else src.absolute().name
  if Path(name).name != name or name in (".", ".."):  # WORKDIR/NAME.toml stays inside the workdir
    raise UserError(f"--name {name!r}: must be a plain file name (no directory part)")
  files.check_output_dir(w, "--workdir")
  arch = hf.get("architectures")
  arch = ", ".join(map(str, arch)) if isinstance(arch, list) else str(arch or "")
  text = toml_text(sections, f"Imported by `python -m jaxtrain.hf import {src}`: {hf['model_type']}, {arch}.")
  return ImportPlan(src, w, name, cfg, text, headers, tok if tok.is_file() else None)


def _stored_dtype(t: Tensor, headers: dict, ours) -> np.dtype:
  """The dtype a parameter is saved in: its tensors' own (one dtype, widening exactly to `ours`, the parameter's),
  so that the import holds and writes what it read; the first train casts it on restore."""
  import jax.numpy as jnp
  kinds = {headers[n][2] for n in t.names.flat}
  own = {"F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16}.get(kinds.pop()) if len(kinds) == 1 else None
  return np.dtype(own) if own is not None and ours == np.float32 else np.dtype(ours)


def run_import(plan: ImportPlan, mesh) -> Path:
  """Places every tensor onto its sharding, in its own dtype, and commits a step-0 checkpoint of the parameters
  alone (no optimizer state: the first train creates it, checkpoint.PARAMS_ONLY); returns the config path."""
  import jax
  from jaxtrain import data
  from jaxtrain.parallel import mesh as mesh_lib
  from jaxtrain.run import checkpoint, progress
  from jaxtrain.run import step as step_lib
  t0 = time.perf_counter()
  cfg, w = plan.cfg, plan.workdir
  is_writer = jax.process_index() == 0
  if is_writer:  # the source's digests, for an adapter export to check its base against (hf_source)
    weights = {f for f, _, _ in plan.headers.values()} | ({INDEX} if (plan.hf_dir / INDEX).is_file() else set())
    digests = hf_source.record(plan.hf_dir, weights)
    (w / "hf").mkdir(parents=True, exist_ok=True)
    for f in HF_KEPT:  # kept for export: token ids and fields jaxtrain does not model
      if (plan.hf_dir / f).is_file():
        shutil.copyfile(plan.hf_dir / f, w / "hf" / f)
    if plan.tokenizer is not None:
      shutil.copyfile(plan.tokenizer, w / "tokenizer.json")
    (w / f"{plan.name}.toml").write_text(plan.toml)
  setup = step_lib.Setup(cfg, mesh)
  cfg = setup.cfg  # with what the mesh implies (a pipeline's stacked layers)
  by_path = {t.path: t for t in table(cfg.model)}
  # LoRA: the base is read (QLoRA: quantized a tensor at a time), its adapters start fresh
  params, nread = _place_params(plan, by_path, *_frozen_base(setup))
  params = setup.with_adapters(params)
  ck = cfg.checkpoint
  # the params fill host memory on a CPU machine: orbax's compressed write buffers are kept to a window
  window = max([2**30] + [x.nbytes for x in jax.tree.leaves(params)])
  ckpts = checkpoint.Checkpoints(w / "checkpoints", ck.keep, ck.keep_every, async_save=False, is_writer=is_writer,
                                 verify=ck.verify, write_window=window)
  # A step-0 import took no step and read no data: later runs may change train settings and data.
  fp = {**checkpoint.fingerprint(cfg, data.tokenizer_digest(cfg), ""), "train": checkpoint.ANY,
        "data": checkpoint.ANY}
  body = {"contents": checkpoint.PARAMS_ONLY, "progress": vars(progress.Progress()),
          "data_state": {"version": 1, "step": 0}, "mesh": mesh_lib.describe(dict(mesh.shape)), "fingerprint": fp,
          "config": cfg.to_dict(), "seed": cfg.train.seed, "process_count": jax.process_count(),
          "imported_from": {"dir": str(plan.hf_dir.absolute()), "tensors": len(plan.headers),
                            **({"files": digests()} if is_writer else {})}}
  try:
    ckpts.save(0, {"params": params}, body)  # the manifest's digests: the one pass over what was written
  finally:
    ckpts.close()
  print(f"imported {len(plan.headers)} tensors ({nread / 2**30:.2f} GiB read) from {plan.hf_dir} in "
        f"{time.perf_counter() - t0:.1f}s: {setup.n_params:,} params, step-0 checkpoint (parameters only: the first "
        f"train creates the optimizer state) in {w / 'checkpoints' / '0'}")
  return w / f"{plan.name}.toml"


def _frozen_base(setup):
  """(abstract params to place, what to make of each placed one): the parameters, or LoRA's frozen base (as stored,
  but QLoRA's quantized weights placed dense on their compute sharding and quantized to their stored one as each
  arrives, so that one dense tensor at a time is held)."""
  import jax
  from jaxtrain.model import roles
  cfg, layout = setup.cfg.model, setup.layout

  def at(tree, path):
    for k in path:
      tree = tree[getattr(k, "key", getattr(k, "idx", k))]
    return tree

  @functools.cache  # one program per (role, sharding): the layers of an unscanned model share it
  def quantizer(role, sh):
    return jax.jit(lambda w: roles.quantized(role, w), out_shardings=sh)

  def finish(path, x):
    role = roles.of(cfg, path)
    return x if role.quant == "none" else quantizer(role, at(layout.stored, path))(x)
  return setup.base_abstract(), finish


def _place_params(plan: ImportPlan, by_path: dict, abstract_params, finish=None) -> tuple[Any, int]:
  """(params on their shardings, each in `_stored_dtype`, then `finish`(path, array) if given; bytes read): every
  device reads its own part."""
  import jax
  safe_open, nread = safetensors_api().safe_open, [0]

  def get(name, t, index, dtype):
    # Our part `index` of one HF tensor: only that part is read; the file is opened per read, so no mapping
    # outlives it.
    with safe_open(str(plan.headers[name][0]), framework="numpy") as st:
      if plan.headers[name][2] == hf_gptoss.MXFP4:
        hf_index, raw = None, hf_gptoss.read(st, name)  # decoded whole, then cut
      else:
        part = st.get_slice(name)
        hf_index = _hf_index(t, index)
        raw = part[hf_index] if hf_index is not None else part[:]
    nread[0] += raw.nbytes
    raw = raw.astype(dtype, copy=False)
    if hf_index is None:  # a part the file does not hold contiguously: cut from the whole tensor
      return np.ascontiguousarray(t.to_ours(raw)[index])
    return raw if t.ours is None else raw.T.reshape([len(range(*s.indices(n))) for s, n in zip(index, t.ours)])

  def shard(t, index, dtype):  # the part `index` (slices over our shape) of parameter t
    ns = t.names.ndim
    sub = np.asarray(t.names[index[:ns]], dtype=object)
    blocks = [get(n, t, index[ns:], dtype) for n in sub.flat]
    return np.stack(blocks).reshape(sub.shape + blocks[0].shape) if ns else blocks[0]

  def place(path, x):
    t = by_path[tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)]
    dtype = _stored_dtype(t, plan.headers, x.dtype)
    x = jax.make_array_from_callback(x.shape, x.sharding, lambda index: shard(t, index, dtype))
    return x if finish is None else finish(path, x)

  return jax.tree_util.tree_map_with_path(place, abstract_params), nread[0]
