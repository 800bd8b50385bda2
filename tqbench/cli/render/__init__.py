"""Rich tables and Markdown reports of engine results (typed dataclasses, read by attribute; ``--json`` is
their ``to_dict()``): ``console`` (the consoles, model loading), ``progress`` (events as progress bars and
streamed text), ``formats`` (shared cell formats), one module per command family (``tables``: bench and
policies; ``validate``; ``compare``: compare-policies and niah; ``scan``; ``estimate``: kv-estimate)."""
