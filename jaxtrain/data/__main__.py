"""The `data` command: `python -m jaxtrain.data prepare|show|bench` (make token shards; print one training row;
time the loader)."""

from __future__ import annotations

import os
import sys

from jaxtrain import cli
from jaxtrain.core.errors import UserError


def parse_args(argv=None):
  p = cli.Parser(prog="jaxtrain.data", description="Prepare token shards; benchmark the data pipeline.")
  sub = p.add_subparsers(dest="command", required=True, parser_class=cli.Parser)
  pr = sub.add_parser("prepare", help="tokenize .txt/.jsonl/.parquet inputs into token shards + manifest")
  pr.add_argument("--input", nargs="+", required=True, metavar="PATH", help=".txt, .jsonl or .parquet files")
  pr.add_argument("--tokenizer", default="byte", help="'byte', a Hugging Face tokenizer.json, or the folder "
                  "save_pretrained wrote (tokenizer.json, tokenizer_config.json's special tokens, chat template)")
  pr.add_argument("--output", required=True, metavar="DIR", help="where the shards and manifest.json go")
  pr.add_argument("--text-field", default="text", help="JSONL field / Parquet column holding the text")
  pr.add_argument("--prompt-field", help="supervised data: field of the prompt (masked out of the loss)")
  pr.add_argument("--completion-field", help="supervised data: field of the completion (trained on)")
  pr.add_argument("--chosen-field", help="preference data (train.objective=dpo): field of the preferred response; "
                  "with --prompt-field and --rejected-field")
  pr.add_argument("--rejected-field", help="preference data: field of the dispreferred response")
  pr.add_argument("--chat-field", help="chat data: field holding a list of {role, content} turns, rendered with "
                  "the tokenizer's chat template; only assistant turns are trained on")
  pr.add_argument("--chat-template", metavar="FILE", help="chat data: a Jinja chat template with {%% generation %%} "
                  "markers (default: chat_template.jinja or tokenizer_config.json beside the tokenizer.json)")
  pr.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizer processes (default: CPUs)")
  pr.add_argument("--shard-mb", type=float, default=64.0, help="input megabytes per shard (default 64)")
  pr.add_argument("--max-bad-records", type=int, default=0,
                  help="skip (and count) up to N unreadable records instead of stopping (default 0)")
  pr.add_argument("--bos-token", help="tokenizer.json: the BOS token (default: a common one if present)")
  pr.add_argument("--eos-token", help="tokenizer.json: the EOS token (default: a common one)")
  pr.add_argument("--dedup", default="none", choices=("exact", "near", "none"),
                  help="drop duplicate records, keeping the first in input order: exact = same text after "
                  "normalization (NFKC, case-folded, whitespace runs as one space); near = MinHash/LSH estimated "
                  "Jaccard similarity of word 5-grams >= --near-threshold (default none)")
  pr.add_argument("--near-threshold", type=float, metavar="J",
                  help="--dedup near: the Jaccard similarity from which a record is a duplicate (default 0.8)")
  pr.add_argument("--min-chars", type=int, metavar="N", help="drop records of fewer than N characters (all their "
                  "texts together)")
  pr.add_argument("--max-chars", type=int, metavar="N", help="drop records of more than N characters")
  pr.add_argument("--no-progress", action="store_true", help="no progress bar (drawn only when stderr is a terminal)")
  sh = sub.add_parser("show", help="print one training row: input -> target pairs, segments, loss mask")
  sh.add_argument("source", help="a prepared dir (or anything data.source accepts)")
  sh.add_argument("--row", type=int, default=0, help="row of epoch 0, as packed for train.seq_len (default 0)")
  cli.add_config_args(sh, help_config=False)
  be = sub.add_parser("bench", help="tokens/s the loader delivers for a config")
  be.add_argument("source", help="a prepared dir (or anything data.source accepts)")
  cli.add_config_args(be, help_config=False)
  be.add_argument("--batches", type=int, default=50, help="batches to time (after one warm-up batch)")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)

  def body(set_prog):
    if args.command == "prepare":
      from jaxtrain.core import files, outputs
      from jaxtrain.data.prepare import prepare
      outputs.check(files.user_path(args.output, "--output"), "--output", "dataset",  # before anything is read
                    sources=[*args.input, *([args.tokenizer] if args.tokenizer != "byte" else []),
                             *([args.chat_template] if args.chat_template else [])])
      for flag, value in (("--bos-token", args.bos_token), ("--eos-token", args.eos_token)):
        if value is not None and args.tokenizer == "byte":
          raise UserError(f"{flag} {value!r}: the byte tokenizer's BOS and EOS are fixed (ids 1 and 2); {flag} "
                          "applies to a tokenizer.json")
      prepare(args.input, args.tokenizer, args.output, text_field=args.text_field,
              prompt_field=args.prompt_field, completion_field=args.completion_field, workers=args.workers,
              shard_mb=args.shard_mb, max_bad_records=args.max_bad_records, bos_token=args.bos_token,
              eos_token=args.eos_token, progress=not args.no_progress, chat_field=args.chat_field,
              chat_template=args.chat_template, chosen_field=args.chosen_field,
              rejected_field=args.rejected_field, dedup=args.dedup, min_chars=args.min_chars,
              max_chars=args.max_chars, near_threshold=args.near_threshold)
    elif args.command == "show":
      from jaxtrain.data import show
      show.show(cli.start(args, "jaxtrain.data", mesh=False, overrides=[f"data.source={args.source}"]).cfg, args.row)
    else:
      from jaxtrain.data import pipeline
      if args.batches < 1:
        raise UserError(f"--batches {args.batches}: must be a positive integer")
      pipeline.bench(cli.start(args, "jaxtrain.data", mesh=False, overrides=[f"data.source={args.source}"]).cfg,
                     args.batches)
  return cli.main("jaxtrain.data", body,
                  interrupted="interrupted (finished shards are kept; re-run the same command to resume)")


if __name__ == "__main__":
  sys.exit(main())
