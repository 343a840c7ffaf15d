"""Pallas attention kernels: shared tile math, a GPU (Triton) and a TPU (Mosaic) forward
kernel, and the pure-JAX backward. The public entry point is
`bam_jax.pallas_attention.pallas_attention`.
"""
