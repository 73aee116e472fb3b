"""`hf export --adapter` names the import's source as its base model: the import recorded that source's files, and
the export refuses a base whose weights changed, warns of one that is gone (issue 54, item 9)."""

import json
import os
import shutil

import pytest

pytest.importorskip("transformers")

from jaxtrain import hf as hf_command  # noqa: E402
from jaxtrain.core import config  # noqa: E402
from jaxtrain.interop import hf_source  # noqa: E402
from jaxtrain.run import checkpoint, loop  # noqa: E402
from tests import hf_models as H  # noqa: E402
from tests.helpers import mesh_of  # noqa: E402


LORA = ["model.lora_rank=4", "model.lora_targets=q,v", "train.batch_size=8", "train.seq_len=16", "data.workers=0",
        "checkpoint.interval=1", "checkpoint.keep=1", "run.tensorboard=false"]


def test_changes_against_the_record_hash_only_what_size_and_time_do_not_settle(tmp_path):
  d = tmp_path / "hf"
  d.mkdir()
  for name, text in (("config.json", "{}"), ("a.safetensors", "0123"), ("b.safetensors", "4567")):
    (d / name).write_text(text)
  rec = hf_source.record(d, [d / "a.safetensors", "b.safetensors"])()
  assert sorted(rec) == ["a.safetensors", "b.safetensors", "config.json"]
  assert hf_source.changes(d, rec) == []
  st = (d / "a.safetensors").stat()
  os.utime(d / "a.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
  assert hf_source.changes(d, rec) == []  # touched: hashed, the same bytes
  (d / "a.safetensors").write_text("0124")  # the same size, other bytes
  (d / "b.safetensors").write_text("45678")
  (d / "config.json").unlink()
  assert hf_source.changes(d, rec) == ["a.safetensors: other contents (sha256)", "b.safetensors: 4 -> 5 bytes",
                                       "config.json: No such file or directory (ENOENT)"]


@pytest.mark.slow  # an import, a train, exports: compiles of whole programs
def test_adapter_export_checks_the_base_it_names(tmp_path, capsys):
  hf_dir, w = tmp_path / "hf", tmp_path / "w"
  H.llama(hf_dir, vocab=320)
  path = H.imported(hf_dir, w, "fsdp=1", LORA)
  loop.run(config.load(str(path)), mesh_of("fsdp=1"), w, "m", stop_at=2)
  assert checkpoint.committed_steps(w / "checkpoints") == [2]  # the import's step 0 rotated away
  capsys.readouterr()

  def export(out, *extra):
    code = hf_command.main(["export", "--workdir", str(w), "--out", str(tmp_path / out), "--adapter", "--mesh",
                            "dp=8", *extra])
    return code, capsys.readouterr().err.strip()

  def base_named(out):
    return json.loads((tmp_path / out / "adapter_config.json").read_text())["base_model_name_or_path"]

  weights = hf_dir / "model.safetensors"
  st = weights.stat()
  os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 5 * 10**9))  # touched (a copy), the same bytes
  assert export("same") == (0, "")
  assert base_named("same") == str(hf_dir.absolute())  # named by step 2's manifest: step 0 is gone

  H.llama(hf_dir, vocab=320, seed=1)  # other weights of the same shapes (the same sizes) in the base's place
  assert weights.stat().st_size == st.st_size
  capsys.readouterr()
  with pytest.raises(SystemExit) as e:
    export("changed")
  err = capsys.readouterr().err.strip()
  assert e.value.code == 2 and len(err.splitlines()) == 1, err
  assert "changed since the import" in err and "model.safetensors" in err and "--allow-base-change" in err
  assert not (tmp_path / "changed").exists()  # refused before anything is written

  code, err = export("allowed", "--allow-base-change")
  assert code == 0 and len(err.splitlines()) == 1 and "warning" in err and "changed since the import" in err
  assert base_named("allowed") == str(hf_dir.absolute())

  shutil.rmtree(hf_dir)
  code, err = export("gone")
  assert code == 0 and len(err.splitlines()) == 1 and "warning" in err and "no longer exists" in err
  assert base_named("gone") == str(hf_dir.absolute())
