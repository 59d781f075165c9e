"""Batched row state of every layer (KV stores and DeltaNet state) with row ops."""
