"""The package version, in a module of its own so the serving layer can name it without importing
the public API (the package's __init__)."""

__version__ = "0.1.0"
