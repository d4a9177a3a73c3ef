"""Test-only: imported through ``VERL_USE_EXTERNAL_MODULES`` by the negative control of
``tests/test_cpu_sft_ds41_on_cpu.py``. Every CP rank's Engram hasher gets zeros where the previous
rank's last token ids should be (what rank 0 gets), so the n-grams at a rank's start lose their
earlier tokens; nothing else changes (the CSA2 halo still runs)."""

import verl_ds4.models.ds41.engram as _engram


def _no_halo(rows, count, group):
    del group
    return rows.new_zeros(count, *rows.shape[1:])


_engram.exchange_left_halo = _no_halo
