"""Compute kernels (no imports from server/, engine/ or models/)."""

if __name__ != "deltaserve.kernels":  # one name per module (deltaserve/__init__.py)
    raise ImportError(f"{__name__}: this folder imports as deltaserve.kernels only")
