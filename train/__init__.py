"""Training pipeline for bam_jax models: data, optimizer, sharding, checkpoints, loop."""
