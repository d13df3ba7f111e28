"""What happened in a run: the run.yaml schema, traces, and the comparison with the plan (pure, no torch)."""
