"""The toy text-to-image world, one module per job: ``grammar`` (prompts, splits, metadata,
caption noise), ``render`` (scenes to images) and ``verify`` (images to GenEval-style verdicts).
The toy model (``pipelines/toy.py``), the ``toy:`` prompt sources and the ``geneval_toy`` reward
all use it."""
