"""Pallas attention kernels: shared tile math and a GPU (Triton) and a TPU (Mosaic) forward
kernel. The public entry point, with the backward pass, is
`bam_jax.pallas_attention.pallas_attention`.
"""
