"""`python -m pose_mlx.perplexity`: runs `pose_mlx.eval.perplexity`, where the command lives."""

import sys

from .eval.perplexity import main

if __name__ == "__main__":
    sys.exit(main())
