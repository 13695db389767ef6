"""The portable Triton kernels: any Triton GPU, and the CPU under the interpreter. ``forward``, ``backward`` and
``decode`` hold each pass's kernels with their launch plans; ``tiles`` their tile tables per head dim, dtype,
pattern and card; ``schedule`` how the dK/dV work is split over programs."""
