"""Compute kernels (no imports from server/, engine/ or models/)."""
