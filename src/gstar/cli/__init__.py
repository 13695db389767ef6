"""The ``gstar`` command line: ``gstar check`` (the autograder), ``gstar bench`` (the benchmark)."""
