"""A training run's surface: its configuration (``runconfig``, importable without PyTorch), how it is
prepared (``runspec``), its data, evaluation and reports, the training loop (``trainer``), inference
with stages missing, and the ``roving pipeline`` command (``cli``)."""
