"""`python -m jaxtrain.data prepare|bench`: make token shards; measure the loader.

    python -m jaxtrain.data prepare --input PATH... --tokenizer byte|tokenizer.json --output DIR
        [--text-field text | --prompt-field F --completion-field F] [--workers N] [--shard-mb MB]
        [--max-bad-records N] [--bos-token T] [--eos-token T]
    python -m jaxtrain.data bench SOURCE [--config tiny] [--set data.workers=4 ...] [--batches N]
"""

from __future__ import annotations

import json
import os
import sys
import time

from jaxtrain import cli
from jaxtrain.core.errors import UserError


def parse_args(argv=None):
  p = cli.Parser(prog="jaxtrain.data", description="Prepare token shards; benchmark the data pipeline.")
  sub = p.add_subparsers(dest="command", required=True, parser_class=cli.Parser)
  pr = sub.add_parser("prepare", help="tokenize .txt/.jsonl/.parquet inputs into token shards + manifest")
  pr.add_argument("--input", nargs="+", required=True, metavar="PATH", help=".txt, .jsonl or .parquet files")
  pr.add_argument("--tokenizer", default="byte", help="'byte' or a path to a Hugging Face tokenizer.json")
  pr.add_argument("--output", required=True, metavar="DIR", help="where the shards and manifest.json go")
  pr.add_argument("--text-field", default="text", help="JSONL field / Parquet column holding the text")
  pr.add_argument("--prompt-field", help="supervised data: field of the prompt (masked out of the loss)")
  pr.add_argument("--completion-field", help="supervised data: field of the completion (trained on)")
  pr.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizer processes (default: CPUs)")
  pr.add_argument("--shard-mb", type=float, default=64.0, help="input megabytes per shard (default 64)")
  pr.add_argument("--max-bad-records", type=int, default=0,
                  help="skip (and count) up to N unreadable records instead of stopping (default 0)")
  pr.add_argument("--bos-token", help="tokenizer.json: the BOS token (default: a common one if present)")
  pr.add_argument("--eos-token", help="tokenizer.json: the EOS token (default: a common one)")
  pr.add_argument("--no-progress", action="store_true", help="no progress bar")
  be = sub.add_parser("bench", help="tokens/s the loader delivers for a config")
  be.add_argument("source", help="a prepared dir (or anything data.source accepts)")
  cli.add_config_args(be, help_config=False)
  be.add_argument("--batches", type=int, default=50, help="batches to time (after one warm-up batch)")
  return p.parse_args(argv)


def bench(args) -> dict:
  from jaxtrain.data import pipeline
  if args.batches < 1:
    raise UserError(f"--batches {args.batches}: must be a positive integer")
  cfg = cli.start(args, "jaxtrain.data", mesh=False, overrides=[f"data.source={args.source}"]).cfg
  it = pipeline.batches(cfg, check_tokenizer=False)  # measures the loader, whatever tokenizer made the data
  next(it)  # opens, verifies and starts the workers
  t0 = time.perf_counter()
  valid = sum(int(next(it)["loss_mask"].sum()) for _ in range(args.batches))
  seconds = time.perf_counter() - t0
  it.close()
  t, d = cfg.train, cfg.data
  tokens = args.batches * t.batch_size * t.seq_len
  out = {"batches": args.batches, "batch_size": t.batch_size, "seq_len": t.seq_len, "workers": d.workers,
         "prefetch": d.prefetch, "seconds": seconds, "tokens_per_sec": tokens / seconds,
         "valid_tokens_per_sec": valid / seconds}
  print(f"bench: {args.batches} batches of {t.batch_size} x {t.seq_len} in {seconds:.3f}s: "
        f"{out['tokens_per_sec']:,.0f} tokens/s ({out['valid_tokens_per_sec']:,.0f} valid tokens/s) "
        f"with data.workers={d.workers}, data.prefetch={d.prefetch}")
  print(json.dumps(out))
  return out


def main(argv=None) -> int:
  args = parse_args(argv)

  def body(set_prog):
    if args.command == "prepare":
      from jaxtrain.data.prepare import prepare
      if args.workers < 1:
        raise UserError(f"--workers {args.workers}: must be a positive integer")
      if args.shard_mb <= 0 or args.max_bad_records < 0:
        raise UserError("--shard-mb must be positive and --max-bad-records non-negative")
      prepare(args.input, args.tokenizer, args.output, text_field=args.text_field,
              prompt_field=args.prompt_field, completion_field=args.completion_field, workers=args.workers,
              shard_mb=args.shard_mb, max_bad_records=args.max_bad_records, bos_token=args.bos_token,
              eos_token=args.eos_token, progress=not args.no_progress)
    else:
      bench(args)
  return cli.main("jaxtrain.data", body,
                  interrupted="interrupted (finished shards are kept; re-run the same command to resume)")


if __name__ == "__main__":
  sys.exit(main())
