"""The ``vllm`` engine: its server (``server.py``), its hidden-state extraction (``extractor.py``,
``extraction.py``, and the KV connector its CPU build loads, ``connector.py``), the acceptance its
counters report (``acceptance.py``), and the roles it serves (``roles.py``)."""
