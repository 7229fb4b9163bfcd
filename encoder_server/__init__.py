"""Encoder server: loads a VLM's vision tower and serves its embeddings over gRPC."""

__version__ = "0.1.0"
