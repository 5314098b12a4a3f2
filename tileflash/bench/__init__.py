"""Benchmarks of tileflash against its peers; run with ``python -m tileflash bench``."""
