"""Hugging Face checkpoints out (`python -m jaxtrain.hf export`); see docs/huggingface.md.

Writes one safetensors file at a time from a committed checkpoint; a rerun into the same folder
replaces what the earlier export wrote there (its record) and nothing else."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shutil
import time
from pathlib import Path

import numpy as np

from jaxtrain.core import files as files_lib, outputs  # files_lib: run_export names its shard list `files`
from jaxtrain.core.errors import UserError
from jaxtrain.interop import hf_source
from jaxtrain.interop.hf import DTYPES, HF_KEPT, INDEX, safetensors_api
from jaxtrain.interop.hf_keys import hf_config
from jaxtrain.interop.hf_table import LORA_MODULES, lora_table, table


ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"  # PEFT's names


def run_export(cfg, mesh, step_dir: Path, out: Path, dtype: str, max_shard_bytes: int, workdir: Path,
               adapter: bool = False, allow_base_change: bool = False) -> None:
  """Writes the HF checkpoint into `out`, replacing what an earlier export wrote there (EXPORT_RECORD) and nothing
  else; a write failure (a full disk) removes this export's partial files and is one line. With LoRA the model is
  written merged (W + A B * alpha / r); `adapter`: the adapters alone, as a PEFT adapter, whose base (the import's
  source) must hold the weights the run was imported from (`allow_base_change`: or a warning)."""
  import jax
  from jaxtrain.run import runs
  t0 = time.perf_counter()
  if adapter and not cfg.model.lora_rank:
    raise UserError(f"--adapter: the run in {workdir} has no adapters (model.lora_rank=0); export without --adapter")
  base = None
  if adapter:
    lora_table(cfg.model)  # what PEFT cannot express (MoE experts' adapters) refused before the params are read
    base = hf_source.check_base(_imported_from(step_dir, workdir), allow_base_change)
  np_dtype = DTYPES[dtype]  # safetensors tags the file dtype from the numpy dtype
  if np_dtype == "bfloat16":
    import ml_dtypes
    np_dtype = ml_dtypes.bfloat16
  _, params = runs.restore_params(cfg, mesh, step_dir)
  if cfg.model.lora_rank and not adapter:
    params = _merged(cfg, params)
  items = [(t.names[s], t, s, math.prod(t.hf_shape) * np.dtype(np_dtype).itemsize // (t.fused or (0, 1))[1])
           for t in (lora_table if adapter else table)(cfg.model) for s in np.ndindex(t.names.shape)]
  files = [items] if adapter else _files(items, max_shard_bytes)
  n, me, total = len(files), jax.process_index(), sum(it[3] for it in items)
  fname = (lambda i: ADAPTER_FILE) if adapter else lambda i: f"model-{i + 1:05d}-of-{n:05d}.safetensors"
  tok = cfg.data.tokenizer != "byte" and not adapter
  written = [ADAPTER_FILE, ADAPTER_CONFIG] if adapter else [
      *map(fname, range(n)), INDEX, "config.json",
      *(["tokenizer.json", *(f for f in HF_KEPT[1:] if (workdir / "hf" / f).is_file())] if tok else [])]
  created = not out.exists()
  try:
    out.mkdir(parents=True, exist_ok=True)
    if me == 0:
      _replace_earlier_export(out, written)
    _write_shards(out, files, fname, params, np_dtype, me)
    if me == 0:
      if adapter:
        _write_adapter_config(cfg.model, out, base)
      else:
        _write_config(cfg, out, workdir, dtype, total, files, fname, tok)
      files_lib.write_json_atomic(out / outputs.EXPORT_RECORD, _record(written, step_dir, workdir, dtype, True))
  except OSError as e:
    _remove_partial(out, written, created and me == 0)
    raise UserError(f"--out {out}: cannot write the export ({files_lib.errno_text(e.errno) if e.errno else e}); "
                    f"its partial files were removed, the checkpoint {step_dir} is untouched: free space (or fix "
                    "--out) and run again") from None
  print(f"exported step {step_dir.name} of {workdir} to {out}: {len({it[0] for it in items})} tensors in {n} file(s), "
        f"{total / 2**30:.2f} GiB {dtype}{', the PEFT adapter' if adapter else ''}, in {time.perf_counter() - t0:.1f}s")


def _files(items: list, max_shard_bytes: int) -> list[list]:
  """Consecutive tensors, a new file when the next would pass max_shard_bytes."""
  files, size = [[]], 0
  for i, it in enumerate(items):  # a fused tensor's parts (consecutive, one name) stay in one file
    if files[-1] and size + it[3] > max_shard_bytes and it[0] != items[i - 1][0]:
      files, size = files + [[]], 0
    files[-1].append(it)
    size += it[3]
  return files


def _merged(cfg, params):
  """LoRA: the base model's parameters with the adapters folded in (float32), on the adapters' devices."""
  import jax
  from jaxtrain.model import lora
  return jax.jit(lambda p: lora.merged(cfg.model, p))(params)


def _imported_from(step_dir: Path, workdir: Path) -> dict:
  """The import the run started from (its manifests carry it; older runs: the step-0 checkpoint's, if kept)."""
  from jaxtrain.run import checkpoint
  for d in (step_dir, workdir / "checkpoints" / "0"):
    if (d / checkpoint.MANIFEST).is_file() and "imported_from" in (manifest := checkpoint.read_manifest(d)):
      return manifest["imported_from"]
  return {}


def _write_adapter_config(m, out: Path, base: str | None) -> None:
  """PEFT's adapter_config.json: a LoRA of rank r on the target modules of a causal LM; the base model is the
  Hugging Face directory the run was imported from (`base`)."""
  from jaxtrain.model import lora
  targets = sorted(LORA_MODULES[lora.WEIGHTS[t]] for t in m.lora_target_names())
  conf = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": m.lora_rank,
          "lora_alpha": m.lora_alpha, "target_modules": targets, "lora_dropout": 0.0, "bias": "none",
          "fan_in_fan_out": False, "use_rslora": False, "modules_to_save": None, "inference_mode": True}
  files_lib.write_atomic(out / ADAPTER_CONFIG, json.dumps(conf, indent=2) + "\n")


def _record(written: list[str], step_dir: Path, workdir: Path, dtype: str, complete: bool) -> dict:
  return {"written_by": "jaxtrain hf export", "complete": complete, "workdir": str(workdir), "step": step_dir.name,
          "dtype": dtype, "files": sorted(written)}


def _replace_earlier_export(out: Path, written: list[str]) -> None:
  """An earlier export's files here (its record names them) go, and nothing else: its old shards (another shard
  count names them differently), index and config. The record lists the old and the new files first, so an
  export killed on the way leaves every file of its own named for the next one to remove."""
  rec = out / outputs.EXPORT_RECORD
  try:
    old = json.loads(rec.read_text())["files"] if rec.is_file() else []
    old = [f for f in old if isinstance(f, str) and Path(f).name == f]  # names of files of this directory only
  except (OSError, ValueError, KeyError, TypeError):
    old = []
  files_lib.write_json_atomic(rec, {"written_by": "jaxtrain hf export", "complete": False,
                                    "files": sorted(set(old) | set(written))})
  for f in set(old) - set(written) | {INDEX, "config.json"}:  # the index and config are rewritten last
    for p in (out / f, out / (f + ".tmp")):
      p.unlink(missing_ok=True)


def _write_shards(out: Path, files: list, fname, params, np_dtype, me: int) -> None:
  import jax
  from jax.experimental import multihost_utils
  safetensors_api()
  from safetensors.numpy import save_file
  for i, entries in enumerate(files):
    mine = i % jax.process_count() == me  # files are spread over the processes
    shard = {}  # host memory: one file's tensors at a time (a fused one's parts interleaved as they come)
    for name, t, s, nbytes in entries:  # every process takes part: a gather is a collective
      x = functools.reduce(lambda x, k: x[k], t.path, params)
      x = x[s] if s else x
      # one tensor at a time: local when this process holds it whole, else gathered once
      x = np.asarray(x) if x.is_fully_addressable else multihost_utils.process_allgather(x, tiled=True)
      arr = np.ascontiguousarray(t.to_hf(np.asarray(x, np.float32)).astype(np_dtype))
      assert arr.nbytes == nbytes, (name, arr.shape, t.hf_shape)
      if t.fused:
        whole = shard.get(name, np.zeros(t.hf_shape, np_dtype))
        whole[..., t.fused[0]::t.fused[1]] = arr
        arr = whole
      assert arr.shape == t.hf_shape, (name, arr.shape, t.hf_shape)
      if mine:
        shard[name] = arr
    if mine:
      tmp = out / (fname(i) + ".tmp")  # a file is whole or absent
      try:
        save_file(shard, tmp, metadata={"format": "pt"})
      except Exception as e:  # noqa: BLE001 (safetensors' own error type, with the OS error in its text)
        if isinstance(e, OSError):
          raise
        raise OSError(files_lib.errno_of(e) or 0, str(e)) from None
      os.replace(tmp, out / fname(i))
    del shard


def _write_config(cfg, out: Path, workdir: Path, dtype: str, total: int, files: list, fname, tok: bool) -> None:
  from jaxtrain.data import tokenizer as tokenizer_lib
  index = {"metadata": {"total_size": total},
           "weight_map": {it[0]: fname(i) for i, entries in enumerate(files) for it in entries}}
  kept = workdir / "hf"
  base = json.loads((kept / "config.json").read_text()) if (kept / "config.json").is_file() else {}
  tokenizer = None
  if tok:
    tokenizer = tokenizer_lib.load(cfg.data.tokenizer)
    shutil.copyfile(tokenizer_lib.json_file(cfg.data.tokenizer), out / "tokenizer.json")
    for f in HF_KEPT[1:]:
      if (kept / f).is_file():
        shutil.copyfile(kept / f, out / f)
  files_lib.write_atomic(out / "config.json", json.dumps(hf_config(cfg, base, dtype, tokenizer), indent=2) + "\n")
  files_lib.write_atomic(out / INDEX, json.dumps(index, indent=2) + "\n")  # last: the export is complete


def _remove_partial(out: Path, written: list[str], remove_dir: bool) -> None:
  """After a failed write: this export's files (whole or torn) and its record go; `out` too if it made it."""
  for f in [*written, outputs.EXPORT_RECORD]:
    for p in (out / f, out / (f + ".tmp")):
      with contextlib.suppress(OSError):
        p.unlink()
  if remove_dir:
    with contextlib.suppress(OSError):
      out.rmdir()
