"""Data: tokenizers, prepared token shards, packing, the host-sharded grain loader, eval.

    from jaxtrain import data
    it = data.batches(cfg, block, blocks)   # next(it), get_state(), set_state(), close()
    # (block, blocks): which rows of each global batch this process feeds (placement.Placement.rows())
    data.eval_batches(cfg, ...), data.source_digest(cfg), data.tokenizer_digest(cfg)

`python -m jaxtrain.data prepare|bench` is the CLI (see __main__.py).
"""

from jaxtrain.data.packing import fields_from_rows
from jaxtrain.data.pipeline import BUNDLED, batches, eval_batches, source_digest, tokenizer_digest
from jaxtrain.data.readers import read_documents
from jaxtrain.data.tokenizer import ByteTokenizer

__all__ = ["BUNDLED", "ByteTokenizer", "batches", "eval_batches", "fields_from_rows", "read_documents",
           "source_digest", "tokenizer_digest"]
