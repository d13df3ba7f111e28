"""The profile's progress phases that say what its training holds (torch-free: hetero.launch.guard reads them)."""

WARMUP = "warm-up steps"  # (steps done, steps): the script's steps, untouched
MEASURED = "measured steps"  # (steps done, steps): under the layer profiler
RECOMPUTED = "blocks recomputed"  # (blocks recomputed, blocks): as each forward that decides has decided
MOVED = "optimizer states on NVMe"  # (parameters moved, parameters): once, where plain training would not fit
TRAINING = (WARMUP, MEASURED, RECOMPUTED, MOVED)  # phases in which the script trains
