if __name__ != "deltaserve.engine":  # one name per module (deltaserve/__init__.py)
    raise ImportError(f"{__name__}: this folder imports as deltaserve.engine only")
