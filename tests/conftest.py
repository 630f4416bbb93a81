"""Shared pytest setup.

Its presence puts `tests/` on `sys.path` (pytest's default prepend import mode),
so test modules in sub-folders can `import factories`.
"""
