"""The three files (profile, plan, run), the trace format, and the one YAML boundary: the bottom of the house.

Imports nothing of hetero but `units` and `errors`; everything else may import it."""
