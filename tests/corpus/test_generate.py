"""The bundled corpus is what its generator makes: regenerated into a temporary file, byte for byte."""

from pathlib import Path

from jaxtrain.corpus import generate


def test_the_generator_reproduces_the_bundled_corpus(tmp_path, capsys):
  generate.main(out=tmp_path / "bundled.jsonl")
  shipped = Path(generate.__file__).with_name("bundled.jsonl")
  assert (tmp_path / "bundled.jsonl").read_bytes() == shipped.read_bytes()
  assert "wrote 2000 documents" in capsys.readouterr().out
