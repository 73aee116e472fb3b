"""What the suite adds to every process's environment, itself and the subprocesses that stand for a user's run
(no import of jax here: tests/conftest.py reads it before the backend starts)."""

# LLVM at -O0 on the CPU backend: compiles take about half the time, and the suite's programs are tiny, so what
# it costs at run time is less than the compile it saves (measured: the not-slow set 426 s -> 264 s on 2 cores;
# four subprocess training tests 238 s -> 191 s). The HLO passes, and so every program property a test reads
# (fusions, collectives, memory), are the same at every level; the last bits of a reduction may not be (another
# summation order), which is why every process of the suite, subprocesses included, compiles alike.
SUITE_XLA_FLAGS = ("--xla_backend_optimization_level=0",)
