"""The autograder behind ``gstar check``: the ten stages (:mod:`.stages`) and their runner (:mod:`.runner`).

Like :mod:`gstar.lab.bench`, nothing here imports triton at import time.
"""
