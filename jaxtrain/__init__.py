"""jaxtrain: a JAX/XLA trainer for decoder-only transformers on one logical mesh."""

import time as _time

__version__ = "0.1.0"

# When Python started this program (goodput's start-up counts from it): now, less the CPU time the interpreter
# took to get here. Not the process's creation: `sh -c 'pip install ...; python -m jaxtrain.train'` runs the
# trainer in the shell's own process (the shell execs its last command), created before the shell's other work.
STARTED_T = _time.time() - _time.process_time()
