"""Run as each of N processes: saves, resumes and damages a small checkpoint (and opens a
prepared dataset) with the checkpoint module's own multi-process paths, counting the bytes
this process hashes; writes <out>.p<i>.json. `--old`: the call that main's trainer made
(restore re-verifies on every process but 0), to measure main with the same harness.

`python -m tests.multihost.verify --launch N --workdir DIR [--rows R] [--pythonpath P] [--old]`
prepares the data, starts the N processes and prints the bytes each hashed."""

import argparse
import json
import sys
import traceback
from pathlib import Path

import numpy as np

import os

from jaxtrain.run import checkpoint
from jaxtrain.parallel import distributed
from jaxtrain.core import files
from jaxtrain.core.errors import RunAborted

COUNT = {"bytes": 0}


def _counting(original):
  def sha256_file(path):
    COUNT["bytes"] += Path(path).stat().st_size
    return original(path)
  return sha256_file


def _instrument():
  """Counts every byte hashed through files.sha256_file, under every name it is imported as."""
  from jaxtrain.data import shards
  counted = _counting(files.sha256_file)
  files.sha256_file = counted
  for module in (checkpoint, shards):
    if hasattr(module, "sha256_file"):
      module.sha256_file = counted


def _taken() -> int:
  n, COUNT["bytes"] = COUNT["bytes"], 0
  return n


def _flip_last_byte(path: Path) -> None:
  blob = bytearray(path.read_bytes())
  blob[-1] ^= 1  # same size, one bit flipped: only the digest can tell
  path.write_bytes(bytes(blob))


def _damage_one(sizes: dict[str, int], n: int) -> str:
  """The largest file that process n-1 (not 0, which reports) checks, or the largest one."""
  names = sorted(sizes)
  if hasattr(checkpoint, "filecheck"):
    own = checkpoint.filecheck.owners([sizes[k] for k in names], n)
    names = [k for k, o in zip(names, own) if o == n - 1]
  return max(names, key=lambda k: (sizes[k], k))


def launch(n: int, tmp: Path, rows: int = 256, pythonpath: str | None = None, old: bool = False):
  """Starts the n processes on a fresh prepared dataset (7 shards); (exit codes, results)."""
  from tests import corpora
  from tests.multihost import procs as multihost
  data = corpora.prepared(tmp, "d", corpora.texts(3000, hi=400), shard_mb=0.1)
  args = ["tests.multihost.verify", "--dir", str(tmp / "run"), "--out", str(tmp / "r"), "--data", data,
          "--rows", str(rows), *(["--old"] if old else [])]
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  codes = multihost.wait_all(multihost.launch(args, n, tmp, env={"PYTHONPATH": pythonpath or root}), 300)
  done = [tmp / f"r.p{i}.json" for i in range(n)]
  return codes, [json.loads(f.read_text()) if f.is_file() else None for f in done]


def _report(a) -> None:
  tmp = Path(a.workdir)
  tmp.mkdir(parents=True)
  codes, res = launch(a.launch, tmp, a.rows, a.pythonpath, a.old)
  if codes != [0] * a.launch:
    from tests.multihost import procs as multihost
    sys.exit(f"exit codes {codes}\n" + multihost.log_of(tmp, 0)[-3000:])
  total = {"save (steps 1+2)": sum(res[0]["step_bytes"].values()), "restore (step 2)": res[0]["step_bytes"]["2"],
           "data open": res[0]["data_bytes"]}
  print(f"{'bytes hashed':<18}" + "".join(f"{'process ' + str(i):>14}" for i in range(a.launch)) + f"{'of':>14}")
  for (what, whole), field in zip(total.items(), ("save", "restore", "data")):
    print(f"{what:<18}" + "".join(f"{r[field]:>14,}" for r in res) + f"{whole:>14,}")


def main():
  p = argparse.ArgumentParser()
  for flag in ("--coordinator", "--dir", "--out", "--data", "--workdir", "--pythonpath"):
    p.add_argument(flag)
  p.add_argument("--num-processes", type=int)
  p.add_argument("--process-id", type=int)
  p.add_argument("--rows", type=int, default=256)
  p.add_argument("--launch", type=int)
  p.add_argument("--old", action="store_true")
  a = p.parse_args()
  if a.launch:
    return _report(a)
  n, me = a.num_processes, a.process_id
  distributed.initialize(distributed.cluster_from(a.coordinator, n, me), {"fsdp": n}, 30, 60)
  import jax
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding, PartitionSpec as P
  _instrument()
  out: dict = {}
  sync = multihost_utils.sync_global_devices
  mesh = jax.make_mesh((n,), ("fsdp",))
  shard = NamedSharding(mesh, P("fsdp"))
  host = {"a": np.arange(a.rows * 1024, dtype=np.float32).reshape(a.rows, 1024),
          "b": np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024) * 0.5}
  state = {k: jax.make_array_from_callback(v.shape, shard, lambda idx, v=v: v[idx]) for k, v in host.items()}
  ckdir, aside = Path(a.dir) / "checkpoints", Path(a.dir) / "checkpoints.aside"

  ck = checkpoint.Checkpoints(ckdir, keep=3, keep_every=0, async_save=True, is_writer=me == 0)
  ck.save(1, state, {"process_count": n})
  ck.save(2, state, {"process_count": n})
  ck.close()
  out["save"] = _taken()
  sync("saved")
  manifest = checkpoint.read_manifest(ckdir / "2")
  out["step_bytes"] = {s: sum(f["size"] for f in checkpoint.read_manifest(ckdir / str(s))["files"].values())
                       for s in (1, 2)}

  step_dir = checkpoint.resume_point(ckdir, None, "fallback", aside)
  ck = checkpoint.Checkpoints(ckdir, keep=3, keep_every=0, async_save=True, is_writer=me == 0)
  abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shard) for k, v in host.items()}
  restored, _ = ck.restore(step_dir, abstract, verified=me == 0 if a.old else True)
  ck.close()
  out["restore"] = _taken()
  out["restored_step"] = int(step_dir.name)
  for k, v in host.items():
    got = multihost_utils.process_allgather(restored[k], tiled=True)
    assert np.array_equal(np.asarray(got), v), k

  damaged = _damage_one({k: f["size"] for k, f in manifest["files"].items()}, n)
  out["damaged"] = damaged
  sync("chosen")
  if me == 0:
    _flip_last_byte(ckdir / "2" / damaged)
  sync("damaged")
  try:
    checkpoint.resume_point(ckdir, None, "stop", aside)
    out["stop"] = None
  except RunAborted as e:  # CheckpointError, or main's "process 0 could not choose" elsewhere
    out["stop"] = str(e)
  chosen = checkpoint.resume_point(ckdir, None, "fallback", aside)
  out["fallback_step"] = int(chosen.name)
  _taken()

  if a.data:
    from jaxtrain.data import shards
    from jaxtrain.core.errors import UserError
    shards.open_prepared(Path(a.data), True)
    out["data"] = _taken()
    entries = [e for s in shards.read_manifest(Path(a.data))["shards"] for e in s["files"].values()]
    out["data_bytes"] = sum(e["bytes"] for e in entries)
    bad = _damage_one({e["name"]: e["bytes"] for e in entries}, n)
    out["data_damaged"] = bad
    sync("data-chosen")
    if me == 0:
      _flip_last_byte(Path(a.data) / bad)
    sync("data-damaged")
    try:
      shards.open_prepared(Path(a.data), True)
      out["data_error"] = None
    except UserError as e:
      out["data_error"] = str(e)
  Path(f"{a.out}.p{me}.json").write_text(json.dumps(out))
  print("done", json.dumps(out), flush=True)


if __name__ == "__main__":
  try:
    sys.exit(main())
  except Exception:  # noqa: BLE001 (the log shows it; the exit code fails the test)
    traceback.print_exc()
    sys.exit(1)
