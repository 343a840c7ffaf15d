"""Evaluation pipelines: passkey retrieval, perplexity by position, prior inspection."""
