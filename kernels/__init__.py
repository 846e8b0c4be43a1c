"""Kernel sources of gqadrv (.cu / .cuh), shipped as package data ``gqadrv._kernels``."""
