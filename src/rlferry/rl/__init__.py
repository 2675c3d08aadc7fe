"""The demo: asynchronous GRPO on a small model, end to end on the three planes.

``rlferry demo`` runs it; this package holds its parts (the task, the model, the GRPO
loss, the processes and the report). Needs the ``[demo]`` extra (transformers,
matplotlib).
"""
