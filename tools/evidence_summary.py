"""Write the package's `pose_mlx/evidence.json`: the summary of the real-model record
(benchmarks/results/real_model/results.json) whose one line `finetune` and `plan` print when they start.

    python tools/evidence_summary.py

Run it whenever the record changes (a new block such as `factor_8x` included); tests/test_evidence.py fails until
the shipped summary equals the record's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from pose_mlx.evidence import RECORD, SHIPPED, summarize

    summary = summarize(json.loads((ROOT / RECORD).read_text()), ROOT)
    SHIPPED.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {SHIPPED.relative_to(ROOT)}: {len(summary['blocks'])} block(s) of {RECORD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
