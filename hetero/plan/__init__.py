"""Pure planning: a Profile in, a Plan out. No torch, no CUDA, no I/O (files are read in `hetero.schema.files`)."""
