"""`python -m jaxtrain.generate`: text from a checkpoint, with a KV cache (docs/huggingface.md).

    python -m jaxtrain.generate --workdir W [--step N] (--prompt TEXT | --prompt-ids 1,2,3 | --prompts-file F)
        [--max-new-tokens N] [--temperature T] [--top-p P] [--seed S] [--mesh M] [--ignore-eos]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxtrain import cli
from jaxtrain.core import files, parse
from jaxtrain.core.errors import UserError


def parse_args(argv=None) -> argparse.Namespace:
  p = cli.Parser(prog="jaxtrain.generate", description="Generate text from a jaxtrain checkpoint (KV-cached).")
  p.add_argument("--workdir", required=True, help="run directory (trained or imported)")
  p.add_argument("--step", type=int, help="committed step to load (default: the latest)")
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--prompt", help="prompt text, encoded with the run's data.tokenizer")
  src.add_argument("--prompt-ids", help="prompt as comma-separated token ids; prints ids")
  src.add_argument("--prompts-file", help="one prompt per line, generated as one batch")
  p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default: 32)")
  p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
  p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: 1)")
  p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
  p.add_argument("--ignore-eos", action="store_true", help="do not stop at the tokenizer's end-of-sequence token")
  cli.add_mesh_args(p)
  return p.parse_args(argv)


def check_args(args) -> None:
  if args.step is not None and args.step < 0:
    raise UserError(f"--step {args.step}: a step is an integer >= 0")
  if not 0 <= args.seed < 2**63:
    raise UserError(f"--seed {args.seed}: must lie in [0, 2**63)")
  if args.max_new_tokens < 1:
    raise UserError(f"--max-new-tokens {args.max_new_tokens}: must be at least 1")
  if not 0 <= args.temperature < float("inf"):  # also refuses nan
    raise UserError(f"--temperature {args.temperature}: must be a finite number >= 0")
  if args.prompt is not None and not args.prompt:
    raise UserError("--prompt '': give some text (or --prompt-ids with the ids to start from)")
  if not 0 < args.top_p <= 1:
    raise UserError(f"--top-p {args.top_p}: must lie in (0, 1]")
  if args.prompt_ids is not None:
    parse.int_items(args.prompt_ids, "--prompt-ids")  # before any checkpoint is read


def prompts_of(args, tok, vocab_size: int) -> tuple[list[str] | None, list[list[int]]]:
  """(prompt texts, or None for --prompt-ids; token ids of each prompt)."""
  if args.prompt_ids is not None:
    ids = parse.int_items(args.prompt_ids, "--prompt-ids")
    if not ids or not all(0 <= i < vocab_size for i in ids):
      raise UserError(f"--prompt-ids {args.prompt_ids!r}: needs at least one id, each in [0, {vocab_size})")
    return None, [ids]
  texts = [args.prompt]
  if args.prompts_file is not None:
    path = Path(args.prompts_file)
    if not path.is_file():
      raise UserError(f"--prompts-file {path}: no such file")
    try:
      texts = [line for line in path.read_text(encoding="utf-8-sig").splitlines() if line.strip()]
    except UnicodeDecodeError as e:
      raise UserError(f"--prompts-file {path}: not UTF-8 text (byte {e.start}); give one prompt per line") from None
    if not texts:
      raise UserError(f"--prompts-file {path}: no non-empty line")
  head = [] if tok.bos_id is None else [tok.bos_id]
  return texts, [head + tok.encode_batch([t])[0].tolist() for t in texts]


def main(argv=None) -> int:
  args = parse_args(argv)

  def body(set_prog):
    check_args(args)
    from jaxtrain.data import tokenizer as tokenizer_lib
    from jaxtrain.interop import decode
    from jaxtrain.run import checkpoint, runs
    workdir = files.user_path(args.workdir, "--workdir")
    step_dir = runs.locate(workdir, args.step)
    cfg = runs.config_of(checkpoint.read_manifest(step_dir))
    tok = tokenizer_lib.load(cfg.data.tokenizer)
    texts, prompts = prompts_of(args, tok, cfg.model.vocab_size)
    limit, source = decode.context_limit(cfg, workdir)  # before any device or array exists
    if (longest := max(map(len, prompts))) + args.max_new_tokens > limit:
      raise UserError(f"--max-new-tokens {args.max_new_tokens}: the longest prompt ({longest} tokens) plus the new "
                      f"tokens must fit the model's context of {limit} positions ({source})")
    started = cli.start(args, "jaxtrain.generate", cfg=cfg, runs_steps=True)
    set_prog(started.prog)
    out, summary = decode.from_checkpoint(cfg, started.mesh, step_dir, prompts, args.max_new_tokens,
                                          temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                                          eos_id=None if args.ignore_eos else tok.eos_id)
    for i, ids in enumerate(out):
      print(",".join(map(str, ids)) if texts is None else texts[i] + tok.decode(ids))
    print(summary, file=sys.stderr)
  return cli.main("jaxtrain.generate", body)


if __name__ == "__main__":
  sys.exit(main())
