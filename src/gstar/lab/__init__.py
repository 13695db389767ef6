"""gstar's laboratory: the autograder (`gstar check`), the benchmark (`gstar bench`), the card's ceilings
(`gstar roofline`), their timing and accuracy bar, the CLI, and the teaching kernels of the first stages. The
library (``import gstar``) never imports it."""
