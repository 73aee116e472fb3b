"""`python -m jaxtrain.launch`: the restart supervisor (supervisor.py); the SLURM and JobSet launch files."""
