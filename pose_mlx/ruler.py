"""`python -m pose_mlx.ruler`: runs `pose_mlx.eval.ruler`, where the command lives."""

import sys

from .eval.ruler import main

if __name__ == "__main__":
    sys.exit(main())
