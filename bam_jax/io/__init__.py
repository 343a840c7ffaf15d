"""Reading and writing what training and evaluation share: workdir paths and atomic file
writes (`files`), text documents and Hugging Face datasets (`documents`), pre-tokenised
shards (`shards`), the parameters of a training checkpoint (`checkpoints`) and folders only
their owner can write, for the caches of compiled code (`private`).

The package itself imports nothing: each module pulls in only what it needs.
"""
