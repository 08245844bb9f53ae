"""Example PyTorch models for the activation-checkpointing scheduler.

Each module exposes a ``build(**kwargs)`` function returning ``(model, example_inputs)``
so that it can be referenced from the command line as ``examples/<name>.py:build`` or
``examples.<name>:build``.
"""
