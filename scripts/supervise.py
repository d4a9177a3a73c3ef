"""Run verl_ds4.recipes.supervise from this checkout (used by scripts/slurm_sft.sbatch on the batch host).

    python scripts/supervise.py --max-restarts 3 ... -- srun ...

The batch script runs on the allocation's first node outside any container (CONTAINER_IMAGE is for the srun
steps), whose Python may not have verl-ds4 installed: the supervisor needs only the standard library and the
checkout, which this puts first on its own module path (not on the steps': their PYTHONPATH is left as it is).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verl_ds4.recipes.supervise import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
