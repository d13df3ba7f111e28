"""The hot code: fused CPU Adam(W) over flat buffers, and later DHA mapping and GPU kernels. Each kernel has a
reference implementation it is tested against."""
