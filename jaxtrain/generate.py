"""`python -m jaxtrain.generate`: text from a checkpoint, with a KV cache.

    python -m jaxtrain.generate --workdir W [--step N] (--prompt TEXT | --prompt-ids 1,2,3 | --prompts-file F)
        [--max-new-tokens N] [--temperature T] [--top-p P] [--seed S] [--mesh M] [--ignore-eos]

The decoder is the training model itself (`Transformer.decode`: the same blocks, with an
optional KV cache in attention) on the same parameter shardings. The prompt goes through
in one pass that fills the cache, then one token per step. Prompts of different lengths
are left-padded: padding has segment id 0, so no real token attends to it, and positions
count from each prompt's first real token. Temperature 0 is greedy; otherwise the
logits are divided by the temperature and sampled from the smallest set of tokens whose
probability reaches top-p, with a key derived from --seed and the step.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


from jaxtrain import cli
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
  p.add_argument("--mesh", default="fsdp=-1", help="device mesh, as for jaxtrain.train (default: fsdp=-1)")
  return p.parse_args(argv)


def check_args(args) -> None:
  if args.max_new_tokens < 1:
    raise UserError(f"--max-new-tokens {args.max_new_tokens}: must be at least 1")
  if args.temperature < 0:
    raise UserError(f"--temperature {args.temperature}: must be >= 0")
  if not 0 < args.top_p <= 1:
    raise UserError(f"--top-p {args.top_p}: must lie in (0, 1]")


def prompts_of(args, tok, vocab_size: int) -> list[list[int]]:
  if args.prompt_ids is not None:
    try:
      ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
    except ValueError:
      raise UserError(f"--prompt-ids {args.prompt_ids!r}: must be comma-separated integers") from None
    if not ids or not all(0 <= i < vocab_size for i in ids):
      raise UserError(f"--prompt-ids {args.prompt_ids!r}: needs at least one id, each in [0, {vocab_size})")
    return [ids]
  if args.prompts_file is not None:
    path = Path(args.prompts_file)
    if not path.is_file():
      raise UserError(f"--prompts-file {path}: no such file")
    texts = [line for line in path.read_text().splitlines() if line.strip()]
    if not texts:
      raise UserError(f"--prompts-file {path}: no non-empty line")
  else:
    texts = [args.prompt]
  head = [] if tok.bos_id is None else [tok.bos_id]
  return [head + tok.encode_batch([t])[0].tolist() for t in texts]


def run(cfg, mesh, args, step_dir: Path) -> list[list[int]]:
  from jaxtrain.data import tokenizer as tokenizer_lib
  from jaxtrain.interop import decode
  from jaxtrain.run import runs
  tok = tokenizer_lib.load(cfg.data.tokenizer)
  prompts = prompts_of(args, tok, cfg.model.vocab_size)
  t0 = time.perf_counter()
  setup, params = runs.restore_params(cfg, mesh, step_dir)
  t1 = time.perf_counter()
  eos = None if args.ignore_eos else tok.eos_id
  timing: dict = {}
  out = decode.generate(cfg, mesh, setup.graphdef, params, prompts, args.max_new_tokens, temperature=args.temperature,
                        top_p=args.top_p, seed=args.seed, eos_id=eos, timing=timing)
  dt = time.perf_counter() - t1
  texts = ([args.prompt] if args.prompt is not None else
           [line for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
           if args.prompts_file is not None else None)
  for i, ids in enumerate(out):
    print(",".join(map(str, ids)) if texts is None else texts[i] + tok.decode(ids))
  n = sum(len(o) for o in out)
  rate = (f"; decoding {timing['batch'] * timing['decode_steps'] / timing['decode_s']:.1f} tokens/s once compiled"
          if timing else "")
  print(f"generated {n} tokens for {len(out)} prompt(s) in {dt:.2f}s (compiles included{rate}; "
        f"loaded step {step_dir.name} in {t1 - t0:.1f}s)", file=sys.stderr)
  return out


def main(argv=None) -> int:
  args = parse_args(argv)

  def body(set_prog):
    check_args(args)
    from jaxtrain.run import checkpoint
    from jaxtrain.run import runs
    step_dir = runs.locate(args.workdir, args.step)
    started = cli.start(args, "jaxtrain.generate", cfg=runs.config_of(checkpoint.read_manifest(step_dir)))
    run(started.cfg, started.mesh, args, step_dir)
  return cli.main("jaxtrain.generate", body)


if __name__ == "__main__":
  sys.exit(main())
