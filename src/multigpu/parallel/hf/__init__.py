"""The transformers adapters, imported only when a model needs them: GPT-2's Conv1D styles (``conv1d.py``),
sequence-parallel styles derived from a declared plan (``sp.py``), tied copies across pipeline stages
(``tied.py``), and a CausalLM cut into pipeline stages (``split.py``) with its stand-ins.
Nothing here imports transformers itself: a model is recognised by what it declares and by class names.
"""
