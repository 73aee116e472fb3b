"""Verification shared out over processes (filecheck.py): each process hashes about
(bytes / processes) of a checkpoint at save and at resume, and of the prepared data at
start-up; a damaged file is still named on every process and the run falls back or stops."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.run import checkpoint
from jaxtrain.run import filecheck
from jaxtrain.core import files
from tests.multihost import procs as multihost, verify as multihost_verify


def test_owners_are_deterministic_and_balanced():
  sizes = [int(s) for s in np.random.default_rng(0).integers(1, 10**6, 300)] + [5 * 10**6, 0, 0]
  for n in (1, 2, 3, 8):
    own = filecheck.owners(sizes, n)
    assert own == filecheck.owners(list(sizes), n) and set(own) == set(range(n))
    loads = [sum(s for s, o in zip(sizes, own) if o == p) for p in range(n)]
    assert max(loads) <= sum(sizes) / n + max(sizes)  # the greedy's bound
  own = filecheck.owners([10, 10, 10, 10], 2)
  assert own.count(0) == own.count(1) == 2


@pytest.fixture(scope="module")
def two(tmp_path_factory):
  """The 2-process harness (tests/multihost/verify.py), once: (per-process results, its dir)."""
  tmp = tmp_path_factory.mktemp("verify2")
  codes, res = multihost_verify.launch(2, tmp)
  assert codes == [0, 0], multihost.log_of(tmp, 0)[-2000:] + multihost.log_of(tmp, 1)[-2000:]
  return res, tmp


def _halves(counts, total):
  """Every byte hashed exactly once over the two processes, about half by each."""
  assert sum(counts) == total, (counts, total)
  assert all(0.4 * total <= c <= 0.6 * total for c in counts), (counts, total)


def test_two_processes_each_hash_half_at_save_restore_and_data_open(two):
  res, _ = two
  saved = sum(res[0]["step_bytes"].values())  # steps 1 and 2
  assert saved > 2 * 10**5
  _halves([r["save"] for r in res], saved)
  _halves([r["restore"] for r in res], res[0]["step_bytes"]["2"])  # the latest verifies: only it is read
  assert [r["restored_step"] for r in res] == [2, 2]
  _halves([r["data"] for r in res], res[0]["data_bytes"])


def test_manifest_written_from_both_processes_digests(two):
  _, tmp = two
  step = tmp / "run" / "checkpoints" / "1"
  manifest = checkpoint.read_manifest(step)
  on_disk = {str(p.relative_to(step)) for p in step.rglob("*") if p.is_file() and p.name != "manifest.json"}
  assert set(manifest["files"]) == on_disk and any("process_1" in k for k in on_disk)
  for name, rec in manifest["files"].items():
    assert rec == {"size": (step / name).stat().st_size, "sha256": files.sha256_file(step / name)}, name


def test_a_damaged_file_is_named_on_every_process_and_the_run_falls_back(two):
  res, tmp = two
  name = res[0]["damaged"]
  for r in res:  # process 1 hashed the damaged file; process 0 names it all the same
    assert r["stop"].startswith(f"checkpoint {tmp / 'run' / 'checkpoints' / '2'} is damaged: file {name} "
                                "does not match its recorded sha256; checkpoints that verify: steps 1")
    assert r["fallback_step"] == 1
    assert r["data_error"].endswith(f"{res[0]['data_damaged']}: sha256 does not match the manifest "
                                    "(corrupt or replaced; re-run prepare)")
  log = multihost.log_of(tmp, 0)
  assert f"file {name} does not match its recorded sha256; moved it to" in log
  assert [p.name.split(".")[:2] for p in (tmp / "run" / "checkpoints.aside").iterdir()] == [["2", "damaged"]]


def _saved(tmp_path, mode):
  ck = checkpoint.Checkpoints(tmp_path / "checkpoints", 3, 0, False, verify=mode)
  ck.save(1, {"a": jnp.arange(4096.0)}, {})
  ck.close()
  step = tmp_path / "checkpoints" / "1"
  files_ = checkpoint.read_manifest(step)["files"]
  return step, files_, step / max(files_, key=lambda k: files_[k]["size"])


def test_verify_sizes_and_off_on_one_process(tmp_path):
  step, recorded, big = _saved(tmp_path / "sizes", "sizes")
  assert all(set(rec) == {"size"} for rec in recorded.values())  # nothing was read to hash
  big.write_bytes(big.read_bytes()[:-1])
  assert checkpoint._problem(step, "full").endswith(f"has {big.stat().st_size} bytes, the manifest recorded "
                                                    f"{big.stat().st_size + 1}")
  step, recorded, big = _saved(tmp_path / "off", "off")
  big.unlink()
  assert checkpoint._problem(step, "off") is None
  assert checkpoint._problem(step, "sizes").endswith(f"file {big.relative_to(step)} is missing")
  (step / "manifest.json").unlink()  # off still needs the manifest: without it the save never committed
  assert checkpoint._problem(step, "off").startswith(f"checkpoint {step}: unreadable manifest.json")
