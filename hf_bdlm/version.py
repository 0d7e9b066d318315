"""The package version (its own module, so that submodules read it without importing the package root)."""

__version__ = "0.1.0"
