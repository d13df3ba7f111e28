"""The hot code: fused CPU Adam(W) over flat buffers, and the DHA mapping with the GPU devices it drives. Each
kernel has a reference implementation it is tested against."""
