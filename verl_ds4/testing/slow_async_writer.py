"""Hold the shard writes of one checkpoint of a real run (tests): an async save that stays in flight.

Imported in the trainer's processes through ``VERL_USE_EXTERNAL_MODULES`` (add
``verl_ds4.testing.slow_async_writer``) with ``VERL_DS4_TEST_SLOW_SAVE=<text>:<seconds>``: Megatron's
shard writer (``FileSystemWriterAsync.write_preloaded_data``, run in the processes an async save forks)
sleeps ``seconds`` before writing a file whose path contains ``<text>`` (e.g. ``global_step_4/``), then
writes it as usual. Every other file, and every process without the variable, is written as before.
``tests/test_cpu_sft_on_cpu.py`` kills a run while such a save is in flight.
"""

from __future__ import annotations

import functools
import os
import time

ENV = "VERL_DS4_TEST_SLOW_SAVE"


def _parse(value: str) -> tuple[str, float]:
    text, sep, seconds = value.rpartition(":")
    if not sep or not text:
        raise ValueError(f"{ENV}={value!r}: expected <text in the path>:<seconds>, e.g. global_step_4/:600")
    return text, float(seconds)


def install() -> bool:
    """Wrap Megatron's shard writer when :data:`ENV` is set (idempotent); False when it is not set."""
    value = os.environ.get(ENV)
    if not value:
        return False
    text, seconds = _parse(value)
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    original = FileSystemWriterAsync.__dict__["write_preloaded_data"].__func__
    if getattr(original, "__verl_ds4_slow__", False):
        return True

    @functools.wraps(original)
    def write_preloaded_data(transform_list, local_proc_idx, write_bucket, *args, **kwargs):
        if text in str(write_bucket[0]):
            time.sleep(seconds)
        return original(transform_list, local_proc_idx, write_bucket, *args, **kwargs)

    write_preloaded_data.__verl_ds4_slow__ = True
    FileSystemWriterAsync.write_preloaded_data = staticmethod(write_preloaded_data)
    return True


install()
