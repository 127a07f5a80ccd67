"""Speculative decoding inside the continuous batch: draft sources and the acceptance rule."""
