"""Benchmarks and the demo: every system measured side by side in one run, reported as ratios."""
