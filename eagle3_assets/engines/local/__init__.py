"""The ``local`` engine: the target in this process, through transformers (the embedded default)."""
