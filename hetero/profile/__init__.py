"""Measuring: the machine and every layer of a training script, into a Profile."""
