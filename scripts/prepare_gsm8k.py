#!/usr/bin/env python3
"""Prepare GSM8K for the DS4 recipes: an SFT `messages` parquet and an RL parquet.

    python scripts/prepare_gsm8k.py                          # hub: openai/gsm8k
    python scripts/prepare_gsm8k.py --source ./gsm8k_local   # local .jsonl/.parquet files

Outputs default to ~/data/gsm8k_ds4_sft/{train,test}.parquet and ~/data/gsm8k_ds4_rl/{train,test}.parquet,
the launchers' TRAIN_FILES / VAL_FILES defaults. See verl_ds4/recipes/gsm8k.py for the formats.
"""

import sys

from verl_ds4.recipes.gsm8k import main

if __name__ == "__main__":
    sys.exit(main())
