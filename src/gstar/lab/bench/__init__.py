"""The machinery behind ``gstar bench`` and ``gstar check`` (docs/design.md sections 4 and 5): cases, peers,
measurement, reports.

Nothing here imports triton or ``gstar.kernels`` at import time: the command-line parser imports these
modules, and on a CPU-only machine ``TRITON_INTERPRET=1`` must be set before triton is first imported.
"""
