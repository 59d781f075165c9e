if __name__ != "deltaserve.models":  # one name per module (deltaserve/__init__.py)
    raise ImportError(f"{__name__}: this folder imports as deltaserve.models only")
