"""DS4 RL prompts for verl's ``main_ppo`` (``data.custom_cls``): verl's ``RLHFDataset`` with its length filter on
DS4's encoder, and a count.

verl's ``RLHFDataset`` measures prompts for ``data.filter_overlong_prompts`` with ``tokenizer.apply_chat_template``,
which DS4 checkpoints do not have; its agent loop renders them with DS4's encoder (verl's
``DeepSeekV4ContinuousTokenBuilder``, chosen by ``model_type``) and left-truncates a prompt longer than
``rollout.prompt_length`` with a log line. :class:`DS4RLHFDataset` is ``RLHFDataset`` with one method replaced:
:meth:`maybe_filter_out_long_prompts` measures every prompt with that same builder (the same
``data.apply_chat_template_kwargs``, the tools of ``data.tool_config_path``) and, at start-up:

- prints how many of the prompts are longer than ``data.max_prompt_length`` and the longest;
- ``data.filter_overlong_prompts=true``: drops them (verl's option; counted);
- else, with ``data.truncation=error``: refuses to start (the agent loop would truncate them), naming the count and
  the fix; with another ``data.truncation`` (your choice) keeps them and says the agent loop will keep their
  last ``max_prompt_length`` tokens.

Select it in the RL config (the DS4 GPU recipes do)::

    data.custom_cls.path=pkg://verl_ds4.models.ds4.rl_dataset
    data.custom_cls.name=DS4RLHFDataset
"""

from __future__ import annotations

from typing import Any

from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.utils.tokenizer.deepseek import DeepSeekV4ContinuousTokenBuilder

LENGTH_COLUMN = "_ds4_prompt_tokens"


class OverlongPromptsError(ValueError):
    """Prompts longer than ``data.max_prompt_length`` with no filter and ``data.truncation=error``."""


class DS4RLHFDataset(RLHFDataset):
    """verl's ``RLHFDataset`` whose length filter measures prompts as the DS4 rollout renders them (module doc).

    After construction: ``num_prompts`` (before the filter), ``num_overlong``, ``longest_prompt`` (tokens) and
    ``num_filtered`` (dropped by ``data.filter_overlong_prompts``)."""

    def prompt_builder(self) -> Any:
        """The builder verl's agent loop uses for ``model_type=deepseek_v4`` (same chat-template kwargs)."""
        return DeepSeekV4ContinuousTokenBuilder(self.tokenizer, chat_template_kwargs=dict(self.apply_chat_template_kwargs or {}))

    def maybe_filter_out_long_prompts(self, dataframe=None):
        builder, tools, key = self.prompt_builder(), self.tool_schemas, self.prompt_key

        def measure(doc: dict) -> dict:
            return {LENGTH_COLUMN: len(builder.build_initial_tokens(self._build_messages(doc, key=key), tools=tools))}

        workers = self.num_workers if self.num_workers and len(dataframe) > 1000 else None
        measured = dataframe.map(measure, num_proc=workers, desc="Measuring DS4 prompts")
        lengths = measured[LENGTH_COLUMN]
        limit = int(self.max_prompt_length)
        self.num_prompts = len(lengths)
        self.num_overlong = sum(1 for n in lengths if n > limit)
        self.longest_prompt = max(lengths, default=0)
        self.num_filtered = 0
        head = (f"DS4RLHFDataset: {self.num_overlong} of {self.num_prompts} prompts are longer than data.max_prompt_length="
                f"{limit} tokens (longest {self.longest_prompt}, rendered with DS4's encoder)")
        if self.num_overlong and self.filter_overlong_prompts:
            keep = [i for i, n in enumerate(lengths) if n <= limit]
            self.num_filtered = self.num_prompts - len(keep)
            print(f"{head}: dropped them (data.filter_overlong_prompts=true); {len(keep)} left.", flush=True)
            if not keep:
                raise OverlongPromptsError(f"{head}: none is left. Fix: raise ds4.max_seq_len (launcher MAX_SEQ_LEN) or "
                                           "data.max_prompt_length.")
            return dataframe.select(keep)
        if self.num_overlong and self.truncation == "error":
            raise OverlongPromptsError(
                f"{head}, and data.filter_overlong_prompts=false with data.truncation=error: verl's agent loop would "
                "truncate them. Fix: set data.filter_overlong_prompts=true (drop them, counted), raise ds4.max_seq_len "
                "(launcher MAX_SEQ_LEN; the prompt gets min(N/4, 8192)) or data.max_prompt_length, or shorten the prompts."
            )
        tail = (f": kept (data.truncation={self.truncation}); verl's agent loop keeps the last {limit} tokens of each."
                if self.num_overlong else ".")
        print(head + tail, flush=True)
        return dataframe
