"""Triton kernels. Importing this package imports triton; ``gstar.api`` does so only when needed."""
