"""Benchmarks that ship with the package (``ddiloco bench …``); scripts in ``benchmarks/`` wrap them."""
