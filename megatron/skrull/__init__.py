"""Megatron-facing layer of Skrull-Megatron: arguments, model spec, data stage, training loop.

``megatron/`` itself is a namespace package shared with the ``megatron-core`` wheel: it must
never get an ``__init__.py``.
"""
