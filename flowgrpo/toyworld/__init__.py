"""The toy text-to-image world, one module per job: ``grammar`` (prompts, splits, metadata,
caption noise), ``render`` (scenes to images) and ``verify`` (images to GenEval-style verdicts).
The toy model (``pipelines/toy.py``), the ``toy:`` prompt sources and the ``geneval_toy`` reward
all use it."""
from flowgrpo.toyworld.editing import EDIT_SPLITS, edit_split
from flowgrpo.toyworld.grammar import prompt_split


def prompt_records(split: str) -> list[dict]:
    """The records of the ``toy:<split>`` prompt source: a text-to-image split of the grammar
    (``train``, ``heldout``) or an editing split (``edit_train``, ``edit_heldout``)."""
    return edit_split(split) if split in EDIT_SPLITS else prompt_split(split)
