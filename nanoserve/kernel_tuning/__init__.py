"""Kernels that tune themselves on the CPU they run on (see tuner.py)."""
