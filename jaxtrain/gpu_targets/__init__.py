"""XLA:GPU target descriptions (.txtpb) for compiling the step for GPUs that are not here."""
