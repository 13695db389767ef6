"""The machinery behind ``gstar bench`` and ``gstar check``: cases, peers, measurement, reports.

Nothing here imports triton or ``gstar.kernels`` at import time: the command-line parser imports these
modules, and on a CPU-only machine ``TRITON_INTERPRET=1`` must be set before triton is first imported.
"""
