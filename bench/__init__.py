"""Benchmarks: each module is a script that prints a table, run from the repository root as
`python -m bench.NAME`; `accelerator_check` is shared by the others, and all divide their
times by the float32 matmul rate of `bam_jax.provenance.matmul_gflops`."""
