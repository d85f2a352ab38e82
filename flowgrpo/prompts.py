"""Prompt sources: the toy world's splits, a text file (one prompt a line) or JSONL.

Every source yields ``{"prompt": str, "metadata": dict}`` records; rewards that verify structure
(the toy verifier, OCR targets) read the metadata. An editing record also carries its source
image: ``"image"``, a float32 tensor (3, H, W) in [0, 1] (``toy:edit_train``, or a JSONL line's
``"image"``, a path relative to the JSONL file, or ``"images"``, a list of such paths for a
multi-image editing model: then ``"image"`` is a ``flowgrpo.model.SourceImages``, the first
image carrying all of them). ``record_images`` and ``reward_metadata`` hand it to the model and
to the rewards (as ``metadata["source_image"]``, which reads as the first image). It may carry
the edit region too: ``"mask"``, float32 (1, H, W) in [0, 1] (the toy edits' exact region, or a
JSONL line's ``"mask"``, a greyscale image path, the first image's size), read by
``training.locality.mask: record``, and the region the edit must leave alone: ``"keep_mask"`` in
the same forms (the toy edits: the source's other objects), read by
``training.locality.keep_region: record``.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from flowgrpo.dotted import import_dotted
from flowgrpo.errors import ConfigError, InputError
from flowgrpo.model import SourceImages
from flowgrpo.pixels import from_uint8
from flowgrpo.prompt_sets import missing_hint
from flowgrpo.seeding import seeded_generator
from flowgrpo.user_files import read_text_file


PROMPT_SUFFIXES = (".txt", ".jsonl")
# The ``toy:<split>`` sources, imported on use by name: a run on other prompts (an LM's) never
# loads the toy world.
TOY_PROMPTS = "flowgrpo.toyworld:prompt_records"
_FORMATS = ("give a .txt file (one prompt a line), a .jsonl file (one {\"prompt\": \"...\", "
            "\"metadata\": {...}} object a line, with \"image\": \"path\" for editing, "
            "\"images\": [\"path\", ...] for several source images) or "
            "toy:train / toy:heldout / toy:edit_train / toy:edit_heldout")


def load_prompts(source: str) -> list[dict]:
    """Records for ``source``: ``toy:<split>``, ``*.txt`` or ``*.jsonl``. Raises InputError (a
    ValueError) naming the file, and for JSONL the line, when the source is missing, of another
    kind (.json, .csv, ... would be read as lines of text and train on their syntax), malformed
    or empty."""
    if source.startswith("toy:"):
        records = import_dotted(TOY_PROMPTS, "prompt source")(source.split(":", 1)[1])
    else:
        path = Path(source)
        suffix = path.suffix.lower()
        if suffix not in PROMPT_SUFFIXES:
            raise InputError(f"prompt file {source}: {suffix or 'no suffix'} is not a prompt "
                             f"format; {_FORMATS}")
        if not path.exists():
            hint = missing_hint(path)
            raise InputError(f"prompt file {source} does not exist"
                             + (hint if hint else f" ({_FORMATS})"))
        # a folder, an unreadable file or one that is not UTF-8 (a binary file, another
        # encoding): one line naming the file
        lines = read_text_file(path, "prompt file", _FORMATS).splitlines()
        if suffix == ".jsonl":
            records = [_jsonl_record(line, f"{source}:{number}", path.parent)
                       for number, line in enumerate(lines, 1) if line.strip()]
        else:
            records = [{"prompt": line.strip(), "metadata": {}} for line in lines if line.strip()]
    if not records:
        raise InputError(f"prompt source {source} holds no prompts (it is empty or only blank "
                         f"lines): {_FORMATS}")
    return records


def _jsonl_record(line: str, where: str, folder: Path | None = None) -> dict:
    """One JSONL line as a record; InputError naming ``file:line`` and what is wrong. An
    ``"image"`` path (relative to ``folder``, the JSONL file's) is loaded as (3, H, W) float32."""
    try:
        item = json.loads(line)
    except ValueError as err:
        raise InputError(f"{where}: not valid JSON ({err}); each line must be one object like "
                         f"{{\"prompt\": \"a red cube\", \"metadata\": {{}}}}") from None
    if not isinstance(item, dict):
        raise InputError(f"{where}: expected a JSON object with a \"prompt\" string, got a JSON "
                         f"{_json_kind(item)}; write {{\"prompt\": ...}}")
    prompt = item.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        got = "no \"prompt\" field" if "prompt" not in item else \
            f"\"prompt\" is a JSON {_json_kind(prompt)}" if not isinstance(prompt, str) else \
            "\"prompt\" is empty"
        raise InputError(f"{where}: {got}; each line needs a non-empty \"prompt\" string")
    metadata = item.get("metadata", {})
    if not isinstance(metadata, dict):
        raise InputError(f"{where}: \"metadata\" must be a JSON object (got a JSON "
                         f"{_json_kind(metadata)})")
    if "image" not in item and "images" not in item:
        for name in ("mask", "keep_mask"):
            if name in item:
                raise InputError(f"{where}: \"{name}\" marks a region of a source image; give "
                                 f"the line an \"image\" too")
        return {"prompt": prompt, "metadata": metadata}
    record = {"prompt": prompt, "metadata": metadata,
              "image": _source_images(item, where, Path(folder or "."))}
    for name in ("mask", "keep_mask"):
        if name not in item:
            continue
        mask = item[name]
        if not isinstance(mask, str) or not mask.strip():
            raise InputError(f"{where}: \"{name}\" must be a path string relative to the JSONL "
                             f"file (got a JSON {_json_kind(mask)})")
        record[name] = load_mask(Path(folder or ".") / mask, where)
        if record[name].shape[-2:] != record["image"].shape[-2:]:
            raise InputError(f"{where}: {name} {mask} is {tuple(record[name].shape[-2:])} but "
                             f"the image is {tuple(record['image'].shape[-2:])}; give the mask "
                             f"the source image's size")
    return record


def _source_images(item: dict, where: str, folder: Path) -> Tensor:
    """A line's source image: ``"image": "path"``, or ``"images": ["path", ...]`` (one or more,
    in order; several become one ``SourceImages``, which is the first image and carries all).
    InputError naming the line and the field: both keys given, a wrong type, an empty list, a
    missing or unreadable file. How many a model takes is its family's (``check_source_images``)."""
    if "image" in item and "images" in item:
        raise InputError(f"{where}: give either \"image\" (one source image) or \"images\" (a "
                         f"list of them), not both")
    if "image" in item:
        image = item["image"]
        if not isinstance(image, str) or not image.strip():
            raise InputError(f"{where}: \"image\" must be a path string relative to the JSONL "
                             f"file (got a JSON {_json_kind(image)})")
        return load_image(folder / image, where)
    paths = item["images"]
    if not isinstance(paths, list) or not paths:
        got = "an empty array" if isinstance(paths, list) else f"a JSON {_json_kind(paths)}"
        raise InputError(f"{where}: \"images\" must be a non-empty array of path strings "
                         f"relative to the JSONL file (got {got})")
    for index, path in enumerate(paths):
        if not isinstance(path, str) or not path.strip():
            raise InputError(f"{where}: \"images\"[{index}] must be a path string relative to "
                             f"the JSONL file (got a JSON {_json_kind(path)})")
    images = [load_image(folder / path, f"{where} \"images\"[{index}]")
              for index, path in enumerate(paths)]
    return images[0] if len(images) == 1 else SourceImages(images)


def _read_pixels(path: Path, mode: str, what: str, where: str, formats: str) -> np.ndarray:
    """The pixels of an image file converted to PIL ``mode``, uint8; a missing or unreadable
    file is an InputError naming the record's field (``what``) and the formats to give."""
    if not path.is_file():
        raise InputError(f"{where}: {what} {path} does not exist; \"{what}\" is a path relative "
                         f"to the JSONL file")
    try:
        with Image.open(path) as handle:
            return np.asarray(handle.convert(mode))
    except OSError as err:
        raise InputError(f"{where}: {what} {path} cannot be read ({err}); give {formats}") from None


def load_image(path: Path, where: str = "") -> Tensor:
    """An image file as float32 (3, H, W) in [0, 1] (RGB; alpha dropped, grey expanded)."""
    return from_uint8(_read_pixels(path, "RGB", "image", where, "a PNG or JPEG"))


def load_mask(path: Path, where: str = "") -> Tensor:
    """A greyscale edit mask as float32 (1, H, W) in [0, 1] (white = the edit region)."""
    pixels = _read_pixels(path, "L", "mask", where, "a PNG")
    return torch.from_numpy(pixels.astype(np.float32) / 255.0)[None]


def record_masks(records: list[dict]) -> list[Tensor]:
    """The records' edit masks (``"mask"``, (1, H, W) in [0, 1]); ValueError naming a record
    without one (``training.locality.mask: record`` needs every record's)."""
    return _required_masks(records, "mask", "training.locality.mask",
                           "training.locality.mask: difference")


def record_keep_masks(records: list[dict]) -> list[Tensor]:
    """The records' preservation regions (``"keep_mask"``, (1, H, W) in [0, 1]); ValueError
    naming a record without one (``training.locality.keep_region: record`` needs every
    record's)."""
    return _required_masks(records, "keep_mask", "training.locality.keep_region",
                           "training.locality.keep_region: rest")


def _required_masks(records: list[dict], name: str, option: str, instead: str) -> list[Tensor]:
    missing = [r["prompt"] for r in records if r.get(name) is None]
    if missing:
        raise ValueError(f"{option} is 'record' but {len(missing)} prompt records have no "
                         f"\"{name}\" (e.g. {missing[0]!r}); give each JSONL line a \"{name}\" "
                         f"image, or use {instead}")
    return [r[name] for r in records]


def record_images(records: list[dict]) -> list[Tensor] | None:
    """The records' source images (one (3, H, W) tensor per record, a ``SourceImages`` for a
    record with several), or None when no record has one (text-to-image). Raises ValueError
    when only some records have one."""
    images = [record.get("image") for record in records]
    if all(image is None for image in images):
        return None
    if any(image is None for image in images):
        missing = next(r["prompt"] for r, i in zip(records, images) if i is None)
        raise ValueError(f"some prompt records have a source \"image\" and some do not (e.g. "
                         f"{missing!r}); an editing prompt file must give every record an image")
    return images


def reward_metadata(records: list[dict]) -> list[dict]:
    """The metadata the rewards see: each record's, plus ``"source_image"`` (3, H, W) when the
    record has a source image (an editing reward compares the output with it)."""
    return [{**record["metadata"], "source_image": record["image"]} if record.get("image") is not None
            else record["metadata"] for record in records]


def _json_kind(value: object) -> str:
    return {str: "string", bool: "boolean", int: "number", float: "number", list: "array",
            dict: "object", type(None): "null"}.get(type(value), type(value).__name__)


def sample_groups(records: list[dict], num_groups: int, seed: int, iteration: int | str,
                  balance_key: str | None = None, weights: Tensor | None = None,
                  bucket_weights: dict[str, float] | None = None) -> list[dict]:
    """The ``num_groups`` prompts of one iteration: a deterministic function of (seed, iteration,
    weights). See ``sample_indices``."""
    buckets = bucket_labels(records, balance_key) if balance_key else None
    return [records[i] for i in sample_indices(len(records), num_groups, seed, iteration,
                                               buckets, weights, bucket_weights)]


def bucket_labels(records: list[dict], balance_key: str) -> list[str]:
    """``str(metadata[balance_key])`` of every record (a missing key reads as "None")."""
    return [str(record["metadata"].get(balance_key)) for record in records]


def check_balance_weights(bucket_weights: dict[str, float], buckets: list[str],
                          balance_key: str) -> None:
    """ConfigError unless every label ``prompts.balance_weights`` names is a value of the training
    prompts' ``metadata[balance_key]`` and some value present can be drawn."""
    labels = sorted(set(buckets))
    unknown = sorted(set(bucket_weights) - set(labels))
    if unknown:
        raise ConfigError(f"prompts.balance_weights names {unknown}, which no training prompt has "
                          f"as metadata[{balance_key!r}]; the values are {labels}")
    if not any(bucket_weights.get(label, 1.0) > 0 for label in labels):
        raise ConfigError(f"prompts.balance_weights gives every value of {balance_key!r} weight "
                          f"0, so no prompt can be drawn; give one a positive weight")


def sample_indices(num_records: int, num_groups: int, seed: int, iteration: int | str,
                   buckets: list[str] | None = None, weights: Tensor | None = None,
                   bucket_weights: dict[str, float] | None = None) -> list[int]:
    """Indices of the ``num_groups`` prompts of one iteration, a pure function of its arguments.

    Without ``buckets``: draws without replacement within an iteration while there are enough
    prompts (then starts another round), uniformly, or with ``weights`` (P,) >= 0 by
    ``torch.multinomial`` (the first draw picks prompt i with probability w_i / sum w). With
    ``buckets`` (one label per prompt, e.g. its family): each group first draws a label
    uniformly, then a prompt of that label, uniformly or by ``weights`` within the label, so a
    rare task family is trained as often as a common one (GenEval's prompt set is dominated by
    one family). ``bucket_weights`` (``prompts.balance_weights``: label -> relative weight, a
    label not named weighs 1) draws the label by those weights instead of uniformly.
    ``draw_probabilities`` gives the closed-form chance of each prompt per draw.
    """
    generator = seeded_generator(seed, iteration, "prompts")
    if weights is not None:
        weights = torch.as_tensor(weights, dtype=torch.float64)
        if weights.shape != (num_records,) or bool((weights < 0).any()) or \
                not bool(torch.isfinite(weights).all()) or float(weights.sum()) <= 0:
            raise ValueError(f"weights must be ({num_records},) finite and >= 0 with a positive "
                             f"sum (got shape {tuple(weights.shape)})")
    if buckets is not None:
        if len(buckets) != num_records:
            raise ValueError(f"buckets must have one label per prompt ({num_records}), "
                             f"got {len(buckets)}")
        members: dict[str, list[int]] = {}
        for index, label in enumerate(buckets):
            members.setdefault(label, []).append(index)
        keys = sorted(members)
        if weights is not None:
            # A label whose prompts all weigh 0 cannot be drawn (a family has no choice in it).
            keys = [k for k in keys if float(weights[members[k]].sum()) > 0]
        label_weights = None
        if bucket_weights:
            keys = [k for k in keys if bucket_weights.get(k, 1.0) > 0]
            label_weights = torch.tensor([bucket_weights.get(k, 1.0) for k in keys],
                                         dtype=torch.float64)
        if not keys:
            raise ValueError("no label can be drawn: every label weighs 0 (prompts.balance_weights "
                             "or the curriculum's weights)")
        picks = []
        for _ in range(num_groups):
            if label_weights is None:      # uniform (the draw every run before the option made)
                choice = int(torch.randint(len(keys), (1,), generator=generator))
            else:
                choice = int(torch.multinomial(label_weights, 1, generator=generator))
            bucket = members[keys[choice]]
            if weights is None:
                picks.append(bucket[int(torch.randint(len(bucket), (1,), generator=generator))])
            else:
                inner = weights[bucket]
                picks.append(bucket[int(torch.multinomial(inner, 1, generator=generator))])
        return picks
    if weights is None:
        order = torch.randperm(num_records, generator=generator).tolist()
        while len(order) < num_groups:
            order += torch.randperm(num_records, generator=generator).tolist()
        return order[:num_groups]
    drawable = int((weights > 0).sum())
    order: list[int] = []
    while len(order) < num_groups:
        count = min(drawable, num_groups - len(order))
        order += torch.multinomial(weights, count, replacement=False, generator=generator).tolist()
    return order


def draw_probabilities(weights: Tensor, buckets: list[str] | None = None,
                       bucket_weights: dict[str, float] | None = None) -> Tensor:
    """(P,) probability that one draw of ``sample_indices`` picks each prompt (its first draw of an
    iteration; later draws within an iteration are without replacement when there are no
    buckets): w_i / sum w, or with buckets (1 / L) * w_i / (sum of w over i's label), over the L
    labels with positive weight; with ``bucket_weights`` b, b_l / (sum of b over those labels)
    in place of 1 / L."""
    weights = torch.as_tensor(weights, dtype=torch.float64)
    if buckets is None:
        return weights / weights.sum()
    totals: dict[str, float] = {}
    for label, weight in zip(buckets, weights.tolist()):
        totals[label] = totals.get(label, 0.0) + weight
    label_weight = {label: (bucket_weights or {}).get(label, 1.0) if total > 0 else 0.0
                    for label, total in totals.items()}
    norm = sum(label_weight.values())
    return torch.tensor([w / totals[label] * label_weight[label] / norm
                         if label_weight[label] > 0 else 0.0
                         for label, w in zip(buckets, weights.tolist())], dtype=torch.float64)


# --------------------------------------------------------------------------- variance curriculum
def mixed_groups(rewards: dict[str, Tensor], group_ids: Tensor, num_groups: int
                 ) -> tuple[Tensor, Tensor]:
    """Which groups carried reward variance: (mixed (G,) bool, informative (G,) bool).

    rewards: key -> (B,) scores (NaN = none) of the batch's samples, group_ids (B,) in
    [0, num_groups). A group is informative when every key has >= 2 valid scores in it, and
    mixed when it is informative and some key's valid scores differ (max > min, exactly as
    ``advantages`` decides that a group carries signal). Pass the keys the advantages use
    ("total", or every component for GDPO)."""
    mixed = torch.zeros(num_groups, dtype=torch.bool)
    informative = torch.ones(num_groups, dtype=torch.bool)
    group_ids = group_ids.long().cpu()
    for values in rewards.values():
        values = values.detach().double().cpu()
        valid = ~values.isnan()
        count = torch.zeros(num_groups, dtype=torch.long).index_add_(0, group_ids, valid.long())
        high = torch.full((num_groups,), -math.inf, dtype=torch.float64).scatter_reduce(
            0, group_ids[valid], values[valid], "amax")
        low = torch.full((num_groups,), math.inf, dtype=torch.float64).scatter_reduce(
            0, group_ids[valid], values[valid], "amin")
        informative &= count >= 2
        mixed |= (count >= 2) & (high > low)
    return mixed & informative, informative


def mixed_probability(mixed: Tensor, groups: Tensor, prior: float, prior_strength: float) -> Tensor:
    """Estimated probability that a prompt's next group is mixed, (P,) float64: the smoothed
    frequency ``(mixed + prior * prior_strength) / (groups + prior_strength)`` of its (decayed)
    counts of mixed groups and of all groups; a prompt never seen gets ``prior``."""
    return (mixed.double() + prior * prior_strength) / (groups.double() + prior_strength)


class PromptCurriculum:
    """CGPO-style variance curriculum: training prompts whose groups had reward variance are drawn
    more often than prompts whose groups were all right or all wrong.

    Keeps per prompt a decayed count of its groups and of its mixed groups (each new group of a
    prompt first multiplies that prompt's counts by ``decay``), and gives each prompt the sampling
    weight ``floor + mixed_probability(...)``. The state is a function of the observed groups in
    order, so processes that observe the same gathered rewards hold the same state; it is saved
    in checkpoints (``state_dict``) for an exact resume.
    """

    def __init__(self, prompts: list[str], floor: float = 0.1, prior: float = 0.5,
                 prior_strength: float = 1.0, decay: float = 0.8) -> None:
        self.fingerprint = prompts_fingerprint(prompts)
        self.floor, self.prior, self.prior_strength, self.decay = floor, prior, prior_strength, decay
        self.groups = torch.zeros(len(prompts), dtype=torch.float64)
        self.mixed = torch.zeros(len(prompts), dtype=torch.float64)

    def probabilities(self) -> Tensor:
        """(P,) estimated probability that each prompt's next group is mixed."""
        return mixed_probability(self.mixed, self.groups, self.prior, self.prior_strength)

    def weights(self) -> Tensor:
        """(P,) sampling weights: floor + estimated probability of a mixed group."""
        return self.floor + self.probabilities()

    def observe(self, indices: list[int], mixed: list[bool]) -> None:
        """Record one group per entry, in order: prompt ``indices[j]`` had a mixed group or not."""
        if len(indices) != len(mixed):
            raise ValueError(f"indices ({len(indices)}) and mixed ({len(mixed)}) must pair up")
        for index, was_mixed in zip(indices, mixed):
            self.groups[index] = self.decay * self.groups[index] + 1.0
            self.mixed[index] = self.decay * self.mixed[index] + float(bool(was_mixed))

    def summary(self, buckets: list[str] | None = None,
                bucket_weights: dict[str, float] | None = None) -> dict[str, float]:
        """``seen_prompts``; ``expected_mixed_share``: the chance that a draw with these weights
        gives a mixed group, by the estimates; ``uniform_mixed_share``: the same for draws without
        the curriculum (uniform, or per bucket drawn uniformly or by ``bucket_weights``)."""
        p = self.probabilities()
        uniform = draw_probabilities(torch.ones_like(p), buckets, bucket_weights)
        drawn = draw_probabilities(self.weights(), buckets, bucket_weights)
        return {"seen_prompts": float((self.groups > 0).sum()),
                "expected_mixed_share": float((drawn * p).sum()),
                "uniform_mixed_share": float((uniform * p).sum())}

    def state_dict(self) -> dict:
        """JSON-safe state (float64 values round-trip exactly through JSON)."""
        return {"fingerprint": self.fingerprint, "groups": self.groups.tolist(),
                "mixed": self.mixed.tolist()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("fingerprint") != self.fingerprint:
            raise ValueError("the checkpoint's curriculum was built on other training prompts "
                             "(prompts.train changed since it was saved); resume with the run's "
                             "prompts or disable prompts.curriculum")
        groups = torch.tensor(state["groups"], dtype=torch.float64)
        mixed = torch.tensor(state["mixed"], dtype=torch.float64)
        if groups.shape != self.groups.shape or mixed.shape != self.mixed.shape:
            raise ValueError(f"curriculum state holds {len(groups)} prompts, expected "
                             f"{len(self.groups)}")
        self.groups, self.mixed = groups, mixed


def prompts_fingerprint(prompts: list[str]) -> str:
    """sha256 of the prompts in order (identifies a training set in a checkpoint)."""
    digest = hashlib.sha256()
    for prompt in prompts:
        digest.update(prompt.encode("utf-8"))
        digest.update(b"\0")
    return f"{len(prompts)}:{digest.hexdigest()}"


def eval_selection(records: list[dict], eval_per_family: int = 0, eval_seeds: int = 1) -> list[dict]:
    """The held-out records to sample at evaluation, one entry per sample (each gets its own noise).

    ``eval_per_family > 0``: exactly that many samples per ``metadata["family"]``, cycling through a
    family's prompts (so a family with one held-out prompt is measured with many seeds as precisely
    as a family with forty); otherwise every record ``eval_seeds`` times. Shared by the trainer's
    evaluation and ``flowgrpo eval CONFIG`` so both score the same samples.
    """
    if eval_per_family <= 0:
        return [r for r in records for _ in range(eval_seeds)]
    by_family: dict[str, list[dict]] = {}
    for record in records:
        by_family.setdefault(str(record["metadata"].get("family")), []).append(record)
    return [family_records[k % len(family_records)] for family_records in by_family.values()
            for k in range(eval_per_family)]


def eval_prompts(records: list[dict], eval_per_family: int = 0) -> list[dict]:
    """The distinct prompts ``eval_selection`` samples, each once, in its order: the first
    ``eval_per_family`` prompts of each family (families in order of first appearance) when
    ``eval_per_family > 0``, else every record (``flowgrpo eval --samples-per-prompt``)."""
    if eval_per_family <= 0:
        return list(records)
    by_family: dict[str, list[dict]] = {}
    for record in records:
        by_family.setdefault(str(record["metadata"].get("family")), []).append(record)
    return [r for family_records in by_family.values() for r in family_records[:eval_per_family]]


def comparison_prompts(records: list[dict], per_family: int = 2, limit: int = 12) -> list[dict]:
    """Rows of the trainer's before/after grid, chosen without looking at any result: the first
    ``per_family`` prompts of each ``metadata["family"]`` in the source's order (families in
    order of first appearance, records without a family as one more group), or the first
    ``limit`` prompts when no record has a family."""
    if not any(record["metadata"].get("family") for record in records):
        return list(records[:limit])
    by_family: dict[str, list[dict]] = {}
    for record in records:
        by_family.setdefault(str(record["metadata"].get("family")), []).append(record)
    return [r for family_records in by_family.values() for r in family_records[:per_family]]
