"""hetero: train PyTorch models larger and faster than GPU memory, using every memory tier of the machine."""

__version__ = "0.1.0"
