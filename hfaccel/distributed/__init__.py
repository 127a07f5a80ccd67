"""Parallel serving across processes: tensor parallelism with sequence parallelism in prefill steps
(`tp`), and what keeps the ranks' engines in lock step (`sync`)."""
