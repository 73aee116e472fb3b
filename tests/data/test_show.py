"""`python -m jaxtrain.data show`: one training row, decoded pair by pair, with segments and the loss mask."""

import io

import pytest

from jaxtrain.core import config
from jaxtrain.data import __main__ as data_command
from jaxtrain.data import show
from jaxtrain.data.prepare import prepare
from tests.corpora import write_jsonl

RECS = [{"q": "AB", "a": "cd"}, {"q": "X", "a": "y"}]
# Each document as (input, target, trained) pairs, worked out by hand: [BOS] prompt completion EOS, where only
# completion and EOS are targets the loss counts; between two documents the pair crosses segments and is masked.
DOCS = {
    "AB": ["<bos>", "A", "B", "c", "d", "<eos>"], "X": ["<bos>", "X", "y", "<eos>"],
}
TRAIN_FROM = {"AB": 3, "X": 2}


def _expected(first: str, second: str) -> list[str]:
  tokens = DOCS[first] + DOCS[second]
  segs = [1] * len(DOCS[first]) + [2] * len(DOCS[second])
  trained = ([i >= TRAIN_FROM[first] for i in range(len(DOCS[first]))]
             + [i >= TRAIN_FROM[second] for i in range(len(DOCS[second]))])
  lines = []
  for i in range(len(tokens) - 1):
    if i == 0 or segs[i] != segs[i - 1]:
      lines.append(f"----- segment {segs[i]} (a document; position 0 of it)")
    mark = "1" if trained[i + 1] and segs[i + 1] == segs[i] else "."
    lines.append(f"{i:>5} {segs[i]:>3} {tokens[i]:<22} -> {tokens[i + 1]:<22} {mark}")
  return lines


@pytest.fixture
def sft(tmp_path):
  src = write_jsonl(tmp_path / "sft.jsonl", RECS)
  prepare([src], "byte", str(tmp_path / "sft"), prompt_field="q", completion_field="a", progress=False)
  return str(tmp_path / "sft")


def test_a_known_row_in_a_pipe_shows_pairs_segments_and_mask(sft, capsys):
  assert data_command.main(["show", sft, "--row", "0", "--set", "train.seq_len=9", "--set", "train.batch_size=2"]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[0].startswith(f"{sft} row 0 of 1 (train.seq_len=9") and out[0].endswith(
      "2 segment(s), 5 of 9 targets trained")
  assert out[1].split() == ["pos", "seg", "input", "target", "loss"]
  assert out[2:] in (_expected("AB", "X"), _expected("X", "AB"))
  assert "\x1b" not in "\n".join(out)  # no colour in a pipe


def test_on_a_terminal_only_trained_targets_are_coloured(sft):
  class Terminal(io.StringIO):
    def isatty(self):
      return True
  out = Terminal()
  show.show(config.load("tiny", [f"data.source={sft}", "train.seq_len=9"]), 0, out)
  rows = [line for line in out.getvalue().splitlines() if "->" in line]
  assert len(rows) == 9
  for line in rows:
    assert (show.GREEN in line) == line.endswith(" 1") and (show.DIM in line) == line.endswith(" .")


def test_a_row_out_of_range_is_a_one_line_user_error(sft, capsys):
  with pytest.raises(SystemExit) as e:
    data_command.main(["show", sft, "--row", "1", "--set", "train.seq_len=9"])
  err = capsys.readouterr().err.strip()
  assert e.value.code == 2 and len(err.splitlines()) == 1
  assert "--row 1: " in err and "has 1 rows of train.seq_len=9 per epoch; give 0 to 0" in err
