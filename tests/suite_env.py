"""What the suite adds to every process's environment, itself and the subprocesses that stand for a user's run
(no import of jax here: tests/conftest.py reads it before the backend starts)."""

# LLVM at -O0 on the CPU backend: compiles take half the time and compute the same numbers (XLA:CPU has no
# fast-math by default, so the optimization level changes no result); the suite's programs are tiny, so what
# it costs at run time is nothing beside the compile it saves. The HLO passes, and so every program property a
# test reads (fusions, collectives, memory), are the same at every level.
SUITE_XLA_FLAGS = ("--xla_backend_optimization_level=0",)
