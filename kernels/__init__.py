"""Compute kernels (import name `kernels`).

`kernels.reference` holds the pure-torch reference of every kernel: the oracle that each faster
implementation (C++ CPU extension, Triton on GPU) is tested against.
"""
