"""`python -m jaxtrain.data show DIR [--row N]`: one packed training row as the trainer reads it (the loader's own
Packer and fields_from_rows): each position's input -> target, decoded, its segment and whether the loss counts it."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from jaxtrain.core.config import Config
from jaxtrain.core.errors import UserError
from jaxtrain.data import pipeline, shards, tokenizer as tokenizer_lib

GREEN, DIM, RESET = "\x1b[1;32m", "\x1b[2m", "\x1b[0m"
WIDTH = 22  # columns for a decoded token


class _Decoder:
  """One token at a time, with the tokenizer that made the data (the manifest's), specials by name."""

  def __init__(self, spec: str):
    self.byte = spec == "byte"
    if not self.byte:
      import tokenizers
      if not Path(spec).is_file():
        raise UserError(f"the data's tokenizer {spec!r} (named in its manifest) is gone: cannot decode the row")
      self._tok = tokenizers.Tokenizer.from_file(spec)

  def __call__(self, i: int) -> str:
    if self.byte:
      names = {tokenizer_lib.ByteTokenizer.PAD: "<pad>", tokenizer_lib.ByteTokenizer.BOS: "<bos>",
               tokenizer_lib.ByteTokenizer.EOS: "<eos>"}
      return names.get(i) or tokenizer_lib.ByteTokenizer().decode([i])
    return self._tok.decode([i], skip_special_tokens=False)


def _cell(text: str) -> str:
  shown = repr(text)[1:-1] if text else "''"
  return shown if len(shown) <= WIDTH else shown[:WIDTH - 1] + "~"


def row_fields(cfg: Config, row: int) -> tuple[dict[str, np.ndarray], int]:
  """Row `row` of epoch 0 of data.source (its training split) as the loader builds it: (fields, rows per epoch)."""
  train, _, pad = pipeline.open_sources(cfg, check_tokenizer=False)
  packer = pipeline.packer(train[0], cfg.train.seq_len, cfg.train.seed, 0, pad)  # tag 0: the only source
  if not 0 <= row < packer.rows_per_epoch:
    raise UserError(f"--row {row}: {cfg.data.source} has {packer.rows_per_epoch} rows of train.seq_len="
                    f"{cfg.train.seq_len} per epoch; give 0 to {packer.rows_per_epoch - 1}")
  fields = pipeline.fields_from_rows({k: v[None] for k, v in packer.row(row).items()})
  return {k: v[0] for k, v in fields.items()}, packer.rows_per_epoch


def show(cfg: Config, row: int, out=None) -> None:
  out = out or sys.stdout
  source = cfg.data.source
  if len(pipeline.source_specs(source)) != 1:
    raise UserError(f"show reads one source, not the mixture {source!r}")
  spec = (shards.read_manifest(Path(source))["tokenizer"]["spec"] if Path(source).is_dir()
          else cfg.data.tokenizer)
  f, rows = row_fields(cfg, row)
  decode, tty = _Decoder(spec), out.isatty()
  B, mask = cfg.train.batch_size, f["loss_mask"]
  print(f"{source} row {row} of {rows} (train.seq_len={cfg.train.seq_len}, train.seed={cfg.train.seed}; "
        f"epoch 0: the batch of step {row // B + 1}, row {row % B} of train.batch_size={B}): "
        f"{len(set(f['segment_ids'].tolist()) - {0})} segment(s), {int(mask.sum())} of {len(mask)} targets trained",
        file=out)
  print(f"{'pos':>5} {'seg':>3} {'input':<{WIDTH}}    {'target':<{WIDTH}} loss", file=out)
  for i in range(len(mask)):
    seg = int(f["segment_ids"][i])
    if i == 0 or seg != f["segment_ids"][i - 1]:
      what = "padding" if seg == 0 else f"segment {seg} (a document; position {int(f['positions'][i])} of it)"
      print(f"----- {what}", file=out)
    a, b = _cell(decode(int(f["inputs"][i]))), _cell(decode(int(f["targets"][i])))
    trained = bool(mask[i])
    if tty:  # colour alone marks the trained targets on a terminal
      b = f"{GREEN}{b:<{WIDTH}}{RESET}" if trained else f"{DIM}{b:<{WIDTH}}{RESET}"
    print(f"{i:>5} {seg:>3} {a:<{WIDTH}} -> {b:<{WIDTH}} {'1' if trained else '.'}", file=out)
