"""The ``gstar`` command line (docs/design.md section 3): ``gstar check`` (the autograder), ``gstar bench``
(the benchmark), ``gstar roofline`` (the card's ceilings)."""
