"""The package version, stamped into every model and package the writers write (and named by `edgelm --version`):
in a module of its own, so export/ and quantize/ read it without importing the edgelm/ folder."""

__version__ = "0.1.0"
