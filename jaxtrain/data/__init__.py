"""Data: tokenizers, `prepare` (token shards + manifest), packing, the host-sharded grain loader, eval
batches, and the digests that identify data in checkpoints. It imports jaxtrain.core and
jaxtrain.run.filecheck and jaxtrain.run.faults (rehearsal hooks) only, never a command module; __main__.py (the `data` command) may import cli."""

from jaxtrain.data.pipeline import (LoaderError, batches, eval_batches, fields_from_rows, most_segments,
                                    source_digest, tokenizer_digest)
from jaxtrain.data.readers import read_documents
from jaxtrain.data.tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "LoaderError", "batches", "eval_batches", "fields_from_rows", "most_segments", "read_documents",
           "source_digest", "tokenizer_digest"]
