"""Helpers for tests and benchmarks only; nothing in the product imports this package.

* :mod:`.megatron_compat`: stand-ins for Megatron-Core features the installed release lacks.
* :mod:`.tiny_gpt`: a per-token attention that makes a real ``GPTModel`` comparable row by row.
"""
