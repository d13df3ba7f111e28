"""Launching `hetero profile` and `hetero run`: one process, or torchrun workers. Above profile/ and run/."""
