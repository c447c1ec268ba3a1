"""`python -m pose_mlx.passkey`: runs `pose_mlx.eval.passkey`, where the command lives."""

import sys

from .eval.passkey import main

if __name__ == "__main__":
    sys.exit(main())
