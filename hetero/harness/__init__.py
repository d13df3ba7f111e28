"""What `hetero profile` and `hetero run` share: running a script as `python script.py` would, finding its
model(s) and optimizer(s), and per-layer hooks. Below both; imports neither."""
