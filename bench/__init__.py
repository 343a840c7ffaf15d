"""Benchmarks: each module is a script that prints a table, run from the repository root as
`python -m bench.NAME`; `matmul_rate` and `accelerator_check` are shared by the others."""
