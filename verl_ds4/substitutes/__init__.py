"""The CPU substitutes of the production path: what stands in for a GPU-only piece when Megatron-LM ``dev``'s own
DeepSeek-V4, built by Megatron-Bridge's provider inside verl's Megatron engine, runs on a CPU.

Everything else of the model's math is Megatron's own code. :data:`verl_ds4.substitutes.registry.SUBSTITUTES` is the
one list (what each replaces, why, and how it is checked against the original); ``docs/architecture.md`` prints it.
:mod:`.megatron_dev` finds and checks the Megatron-LM ``dev`` source tree the proofs import.
"""
