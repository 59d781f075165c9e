"""Tensor-parallel serving: rank 0 plans each step, every rank runs it on its slice."""
