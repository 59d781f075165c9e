"""Scheduling policy: which rows run each step, how much of each prompt, at what cost."""
