"""Serving: replicas that run the trained model with a KV cache and continuous batching, and their HTTP API."""
