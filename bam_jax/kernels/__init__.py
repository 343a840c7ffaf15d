"""The fused attention kernel's backends: the shared tile math (tile_math.py), one module per
platform (gpu.py with gpu_backward.py, tpu.py, cpu.py with cpu_attention.cc), each defining
its `BACKEND` entry (backend.py) gathered in registry.py, and the prior's distance table
(prior_table.py). The public entry point, with the backward pass, is
`bam_jax.fused_attention.fused_attention`.
"""
