"""The serving engine: requests, KV blocks, scheduling, batching, model runs and sampling."""
