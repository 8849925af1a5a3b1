"""What every engine reached over HTTP shares with the generation stage's HTTP engine, below both.

The sample a backend is asked for (``samples.py``), what a reply means (``classify.py``), the
client's connections and a paid API's listed prices (``client.py``), the tool flags a row carries
(``tool_flags.py``) and the wire every backend speaks through (``wire.py``: ``Prepared``,
``Parsed``, ``BackendUnavailable``, the redactor). Each engine's backend lives in its own package
(``sglang/backend.py``, ``openrouter/backend.py``, ``vllm/openai_ids.py``) and its generate role
builds it from the engine's resource; the stage drives whichever backend the role hands it.
"""
