"""``flowgrpo sample / eval / grid`` without --steps / --guidance sample as the stock diffusers
pipeline does (flowgrpo/commands/common.py SAMPLING_DEFAULTS), family by family."""
from __future__ import annotations

import inspect

import diffusers
import pytest

from flowgrpo.commands.common import SAMPLING_DEFAULTS
from pipelines import MODEL_FAMILIES

# family -> (the stock pipeline, the pipeline's guidance argument, scale -> this toolkit's g)
STOCK = {
    "wan": ("WanPipeline", "guidance_scale", lambda s: s),
    "wan_i2v": ("WanImageToVideoPipeline", "guidance_scale", lambda s: s),
    "qwen_image": ("QwenImagePipeline", "true_cfg_scale", lambda s: s),
    "qwen_image_edit": ("QwenImageEditPipeline", "true_cfg_scale", lambda s: s),
    "qwen_image_edit_plus": ("QwenImageEditPlusPipeline", "true_cfg_scale", lambda s: s),
    "z_image": ("ZImagePipeline", "guidance_scale", lambda s: s + 1.0),   # pos + s (pos - neg)
    "flux2": ("Flux2KleinPipeline", "guidance_scale", lambda s: s),
    "flux_kontext": ("FluxKontextPipeline", "guidance_scale", lambda s: s),
    "hunyuan_video": ("HunyuanVideoPipeline", "guidance_scale", lambda s: s),   # guidance embedding
    "ltx2": ("LTX2Pipeline", "guidance_scale", lambda s: s),   # the video's scale (audio: options)
}
# Flow-GRPO's evaluation settings, deliberately not the pipelines' (28 steps / 7.0 for SD3).
ANCHOR_SETTINGS = {"sd3": (40, 4.5), "flux": (28, 3.5)}


def test_every_diffusers_family_has_sampling_defaults():
    assert set(SAMPLING_DEFAULTS) == set(MODEL_FAMILIES) - {"toy"}


@pytest.mark.parametrize("family", sorted(STOCK))
def test_defaults_are_the_stock_pipelines(family):
    name, argument, to_ours = STOCK[family]
    parameters = inspect.signature(getattr(diffusers, name).__call__).parameters
    steps, guidance = SAMPLING_DEFAULTS[family]
    assert steps == parameters["num_inference_steps"].default
    assert guidance == pytest.approx(to_ours(parameters[argument].default))


def test_sd3_and_flux_keep_flow_grpos_evaluation_settings():
    assert {family: SAMPLING_DEFAULTS[family] for family in ANCHOR_SETTINGS} == ANCHOR_SETTINGS
