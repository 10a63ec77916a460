"""Adapters to other people's code: `transformers` attention backends."""
