__version__ = "0.1.0"
"""comera's version, ``MAJOR.MINOR.PATCH`` (semantic versioning; CHANGELOG.md says what each one holds).

Examples:
    >>> import comera
    >>> print(comera.__version__)  # doctest: +SKIP
    0.1.0
"""
