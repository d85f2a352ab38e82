"""Turning a reward spec into a ready reward: name resolution, option checks, device/dtype,
batch chunking and per-frame scoring of videos.

A spec is one of
- a registered name: ``"ocr"``;
- a user's class by path: ``"my_pkg.rewards:Sharpness"``;
- a dict ``{"name": <either of the above>, **options}``. Options go to the class's constructor
  as keyword arguments and are checked against its signature, except these, which ``load_reward``
  handles for every reward:

  =================  ============================================================================
  ``device``         overrides ``load_reward(device=...)`` for this reward ("cpu", "cuda:1", ...);
                     "auto" = the caller's device (the trainer passes each rank's GPU)
  ``batch_size``     score at most this many images (frames) per model call on this process's
                     device (each rank scores its own rows); None = all at once
  ``dtype``          overrides ``load_reward(dtype=...)``; "float32", "float16", "bfloat16"
  ``video_frames``   videos: score this many evenly spaced frames (None = every frame)
  ``video_aggregate``  videos: "mean" (default), "min" or "max" over the scored frames
  =================  ============================================================================

  (``weight`` and ``label`` are read by ``MultiReward`` and ignored here.)

Names resolve in this order: ``REGISTRY`` (built-ins and ``@register_reward`` classes), then
installed packages' entry points in the group ``flowgrpo.rewards`` (``name = "module:Class"``),
then ``"module:Class"`` paths.
"""
from __future__ import annotations

import importlib.metadata
import inspect
from typing import Any

import torch
from torch import Tensor

from flowgrpo.dotted import import_dotted
from flowgrpo.dtypes import parse_dtype
from flowgrpo.errors import ConfigError

from .base import REGISTRY, as_score_vector, score_with_components
from .media import check_media, frame_indices

ENTRY_POINT_GROUP = "flowgrpo.rewards"
GENERIC_OPTIONS = ("device", "dtype", "batch_size", "video_frames", "video_aggregate")
MULTI_REWARD_OPTIONS = ("weight", "label")
VIDEO_AGGREGATES = ("mean", "min", "max")

def _entry_points() -> dict[str, str]:
    return {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def available_rewards() -> list[str]:
    """Every reward name ``load_reward`` accepts: built-ins, registered classes and installed
    packages' entry points (group ``flowgrpo.rewards``). ``"module:Class"`` paths work too."""
    return sorted(set(REGISTRY) | set(_entry_points()))


def check_reward_names(specs: list, where: str, known: list[str], kind: str = "reward") -> None:
    """At config load: every plain reward name of ``specs`` (config ``RewardSpec``s, at
    ``<where>[i]``; an ensemble's ``options.members`` too) must be one of ``known``
    (``available_rewards``, or the text rewards' names); a ConfigError names the field and the
    names there are. ``package.module:Class`` paths are imported only when the reward loads."""
    for i, spec in enumerate(specs):
        if not spec.name or ":" in spec.name:
            continue
        if spec.name not in known:
            raise ConfigError(f"{where}[{i}].name: unknown {kind} {spec.name!r}; available: "
                              f"{', '.join(known)}; or give your own class as "
                              f"'package.module:Class'")
        members = spec.options.get("members") if spec.name == "ensemble" else None
        for j, member in enumerate(members if isinstance(members, list) else []):
            name = member.get("name") if isinstance(member, dict) else member
            if isinstance(name, str) and ":" not in name and name not in known:
                raise ConfigError(f"{where}[{i}].options.members[{j}]: unknown reward {name!r}; "
                                  f"available: {', '.join(known)}; or give your own class as "
                                  f"'package.module:Class'")


def import_class(path: str) -> type:
    """The class at ``"package.module:Class"`` (``Outer.Inner`` allowed after the colon)."""
    return import_dotted(path, "reward")


def resolve_reward_class(name: str) -> type:
    """The class for a registered name, an entry-point name or a ``"module:Class"`` path."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"reward name must be a non-empty string (got {name!r})")
    if name in REGISTRY:
        return import_class(REGISTRY[name])
    entry_points = _entry_points()
    if name in entry_points:
        return import_class(entry_points[name])
    if ":" in name:
        return import_class(name)
    raise ValueError(f"unknown reward {name!r}; available: {', '.join(available_rewards())}; "
                     f"or give your own class as 'package.module:Class'")


def _constructor_parameters(cls: type) -> tuple[dict[str, inspect.Parameter], bool]:
    """Keyword-passable constructor parameters and whether it takes **kwargs."""
    signature = inspect.signature(cls)
    params = {n: p for n, p in signature.parameters.items()
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())
    return params, takes_any


def _split_spec(spec: str | dict) -> tuple[str, dict]:
    if isinstance(spec, str):
        return spec, {}
    if not isinstance(spec, dict):
        raise TypeError(f"reward spec must be a name, 'module:Class' or a dict with 'name' "
                        f"(got {type(spec).__name__})")
    if "name" not in spec:
        raise ValueError(f"reward spec {spec!r} has no 'name'")
    options = {k: v for k, v in spec.items() if k != "name"}
    return spec["name"], options


def load_reward(spec: str | dict, *, device: str | torch.device = "cpu",
                dtype: torch.dtype | str = torch.float32) -> "ManagedReward":
    """Build a reward from a spec (see the module docstring) on ``device`` in ``dtype``.

    ``device``/``dtype`` are passed to the constructor when it takes them. Returns a
    ``ManagedReward``: callable ``(media, prompts, metadata) -> (B,)`` float32 CPU, NaN = no score.
    Raises ValueError for unknown names/options, listing the valid ones."""
    name, options = _split_spec(spec)
    cls = resolve_reward_class(name)
    generic = {k: options.pop(k) for k in GENERIC_OPTIONS if k in options}
    for key in MULTI_REWARD_OPTIONS:
        options.pop(key, None)
    params, takes_any = _constructor_parameters(cls)
    own_options = set(params) - {"device", "dtype"}
    if not takes_any:
        unknown = sorted(set(options) - set(params))
        if unknown:
            valid = sorted(own_options) + list(GENERIC_OPTIONS)
            raise ValueError(f"reward {name!r} has no option {unknown[0]!r}; valid options: "
                             f"{', '.join(valid)}")
    missing = sorted(n for n, p in params.items()
                     if p.default is inspect.Parameter.empty and n not in options
                     and n not in ("device", "dtype"))
    if missing:
        raise ValueError(f"reward {name!r} requires option {missing[0]!r}")
    # "auto" (or no option) = the caller's device: the trainer passes each rank's accelerator.
    asked = generic.get("device", "auto")
    resolved_device = torch.device(device if asked == "auto" else asked)
    resolved_dtype = parse_dtype(generic.get("dtype", dtype))
    if "device" in params or takes_any:
        options.setdefault("device", resolved_device)
    if "dtype" in params or takes_any:
        options.setdefault("dtype", resolved_dtype)
    inner = cls(**options)
    default_name = name.rpartition(":")[2].rpartition(".")[2] if ":" in name else name
    return ManagedReward(inner, name=getattr(inner, "name", None) or default_name,
                         batch_size=generic.get("batch_size"),
                         video_frames=generic.get("video_frames"),
                         video_aggregate=generic.get("video_aggregate", "mean"))


class ManagedReward:
    """A reward plus what every reward needs: input checks, (B,) float32 CPU outputs, chunking
    into ``batch_size`` and per-frame scoring of videos for image rewards.

    Videos (B, F, 3, H, W) given to an image reward: ``video_frames`` evenly spaced frames (all
    when None) are scored as images with the sample's prompt/metadata, then aggregated per video
    with ``video_aggregate`` ("mean", "min", "max"), ignoring NaN frames (NaN only when every
    frame is NaN). Rewards with ``video_native = True`` receive the videos unchanged."""

    def __init__(self, inner, *, name: str, batch_size: int | None = None,
                 video_frames: int | None = None, video_aggregate: str = "mean"):
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"reward {name!r}: batch_size must be an int >= 1 or None "
                             f"(got {batch_size!r})")
        if video_frames is not None and (not isinstance(video_frames, int) or video_frames < 1):
            raise ValueError(f"reward {name!r}: video_frames must be an int >= 1 or None "
                             f"(got {video_frames!r})")
        if video_aggregate not in VIDEO_AGGREGATES:
            raise ValueError(f"reward {name!r}: video_aggregate must be one of {VIDEO_AGGREGATES}"
                             f" (got {video_aggregate!r})")
        self.inner = inner
        self.name = name
        self.batch_size = batch_size
        self.video_frames = video_frames
        self.video_aggregate = video_aggregate
        self.video_native = bool(getattr(inner, "video_native", False))
        self.has_components = callable(getattr(inner, "components", None))
        if self.has_components:
            self.components = self._components

    def __repr__(self) -> str:
        return f"ManagedReward({self.name!r}, inner={type(self.inner).__name__})"

    def __call__(self, media: Tensor, prompts: list[str],
                 metadata: list[dict] | None = None) -> Tensor:
        """(B,) float32 CPU scores; NaN = no score."""
        return self._score(media, prompts, metadata, with_components=False)[0]

    def _components(self, media: Tensor, prompts: list[str],
                    metadata: list[dict] | None = None) -> dict[str, Tensor]:
        return self._score(media, prompts, metadata, with_components=True)[1]

    def score_and_components(self, media: Tensor, prompts: list[str],
                             metadata: list[dict] | None = None
                             ) -> tuple[Tensor, dict[str, Tensor]]:
        """Main score (B,) and components {key: (B,)} ({} for single-score rewards)."""
        return self._score(media, prompts, metadata, with_components=self.has_components)

    # ---- internals ----
    def _score(self, media, prompts, metadata, with_components):
        metadata = check_media(media, prompts, metadata, self.name)
        # Both paths return (batch,) float32 CPU vectors: _chunked checks every chunk's output
        # with as_score_vector, and _score_frames aggregates those per video.
        if media.ndim == 5 and not self.video_native:
            return self._score_frames(media, list(prompts), metadata, with_components)
        return self._chunked(media, list(prompts), metadata, with_components)

    def _chunked(self, media, prompts, metadata, with_components):
        batch = media.shape[0]
        step = self.batch_size or batch
        mains, parts_list = [], []
        for start in range(0, batch, step):
            stop = min(start + step, batch)
            args = (media[start:stop], prompts[start:stop], metadata[start:stop])
            if with_components:
                main, parts = score_with_components(self.inner, *args)
            else:
                main, parts = self.inner(*args), {}
            mains.append(as_score_vector(main, stop - start, self.name))
            parts_list.append({k: as_score_vector(v, stop - start, f"{self.name}.{k}")
                               for k, v in parts.items()})
        keys = parts_list[0].keys()
        # cat copies even a single chunk: the scores never alias a buffer the reward may reuse
        return torch.cat(mains), {k: torch.cat([p[k] for p in parts_list]) for k in keys}

    def _score_frames(self, videos, prompts, metadata, with_components):
        batch, num_frames = videos.shape[:2]
        index = frame_indices(num_frames, self.video_frames)
        frames = videos[:, index.to(videos.device)]                     # (B, n, 3, H, W)
        n = frames.shape[1]
        flat_prompts = [p for p in prompts for _ in range(n)]
        flat_metadata = [m for m in metadata for _ in range(n)]
        main, parts = self._chunked(frames.flatten(0, 1), flat_prompts, flat_metadata,
                                    with_components)
        aggregate = lambda scores: aggregate_frames(scores.view(batch, n), self.video_aggregate)
        return aggregate(main), {k: aggregate(v) for k, v in parts.items()}


def aggregate_frames(scores: Tensor, how: str = "mean") -> Tensor:
    """(B, n) per-frame scores -> (B,) with "mean", "min" or "max", ignoring NaN frames;
    NaN where every frame of a video is NaN."""
    valid = ~torch.isnan(scores)
    if how == "mean":
        total = torch.where(valid, scores, torch.zeros_like(scores)).sum(dim=1)
        result = total / valid.sum(dim=1).clamp(min=1)
    elif how == "min":
        result = torch.where(valid, scores, torch.full_like(scores, float("inf"))).amin(dim=1)
    elif how == "max":
        result = torch.where(valid, scores, torch.full_like(scores, float("-inf"))).amax(dim=1)
    else:
        raise ValueError(f"video_aggregate must be one of {VIDEO_AGGREGATES} (got {how!r})")
    return torch.where(valid.any(dim=1), result, torch.full_like(result, float("nan")))
