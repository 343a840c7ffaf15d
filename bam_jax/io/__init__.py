"""Reading and writing what training and evaluation share: workdir paths and atomic file
writes (`files`), text documents and Hugging Face datasets (`documents`), pre-tokenised
shards (`shards`) and the parameters of a training checkpoint (`checkpoints`).

`import bam_jax` does not import this package, so the model library stays light.
"""
