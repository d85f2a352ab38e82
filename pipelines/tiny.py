"""Tiny random versions of each model family, written to disk in the stock diffusers layout.

``save_tiny(family, directory)`` builds every component of the family's diffusers pipeline from
small configs (random weights, seeded), saves them with ``save_pretrained`` next to a
``model_index.json``, and returns the folder. The folder loads through the same code as the real
checkpoints: the adapter's ``from_pretrained`` and the diffusers pipeline class's own
``from_pretrained``. Nothing is downloaded: the tokenizers are built from small vocabularies
written here (a character-level byte BPE for CLIP, a character-level Unigram for T5/UMT5).

Sizes are chosen so that one transformer forward takes milliseconds on a CPU while keeping the
structure that the adapters depend on:

- the VAE downsamples 8x (4 ``block_out_channels``) like the real ones;
- text-encoder widths feed the transformer without truncation (SD3: CLIP-L + CLIP-G widths sum
  to the T5 width = ``joint_attention_dim``; pooled widths sum to ``pooled_projection_dim``);
- SD3 keeps a dual-attention block and RMS q/k norm (as SD3.5-Medium), FLUX keeps double and
  single blocks and the guidance embedding (as FLUX.1-dev), Wan keeps the 4x temporal / 8x spatial
  causal VAE and the UniPC flow scheduler config of Wan2.1-T2V-1.3B;
- Wan2.2 ("wan22") is Wan2.1's layout with two experts (transformer = high noise, transformer_2 =
  low noise) switched at boundary_ratio 0.875, as Wan2.2-T2V-A14B;
- Qwen-Image keeps a real Qwen2.5-VL text encoder (language model and a vision tower, multimodal
  RoPE) whose width is the transformer's joint_attention_dim, a byte-level BPE tokenizer in which
  the pipeline's prompt template splits into the same 34 leading tokens as Qwen's own tokenizer
  (so the pipeline drops exactly the template), the 8x causal VAE with per-channel latent
  statistics, and Qwen-Image's dynamic-shift scheduler config (shift_terminal 0.02);
- FLUX.2 ("flux2": klein base, "flux2_dev"): the text encoders are deep enough for the layers the
  pipelines read (Qwen3 27, Mistral 30 layers, width 16), the VAE keeps FLUX.2's batch-norm
  latent statistics (set away from the identity), dev keeps the guidance embedding;
- Z-Image ("z_image") keeps a real Qwen3 text encoder (its second-to-last layer is what the
  pipeline reads) of the transformer's cap_feat_dim, the main layers and both refiners, and
  Z-Image-Turbo's static-shift-3 scheduler config;
- HunyuanVideo ("hunyuan_video") keeps a real Llama text encoder behind a Llama-3-style byte-level
  BPE in which the pipeline's prompt template splits into the same 95 leading tokens it crops,
  CLIP's pooled text, the guidance embedding, the token refiner and the causal video VAE;
- LTX-2 ("ltx2") keeps a real Gemma-3 text encoder (every layer's states feed the connectors)
  behind a Gemma BPE built in code, both text connectors, the joint audio+video transformer, both
  VAEs with non-trivial latent statistics, the vocoder and LTX-2's dynamic-shift scheduler.
"""
from __future__ import annotations

import os
import string

import torch

TINY_FAMILIES = ("sd3", "flux", "flux_kontext", "wan", "wan22", "qwen_image", "flux2", "flux2_dev",
                 "wan_i2v", "wan22_i2v", "wan22_ti2v", "z_image", "qwen_image_edit_plus",
                 "hunyuan_video", "ltx2")

# Sizes the tests use with the tiny folders (divisible by 16 = VAE factor 8 x patch size 2).
TINY_HEIGHT = 32
TINY_WIDTH = 32
TINY_NUM_FRAMES = 5


def _byte_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: printable Latin-1 bytes map to themselves, the other bytes to
    code points from 256 upwards, so every byte has a visible, distinct character."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    table: dict[int, str] = {}
    next_code = 256
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(next_code)
            next_code += 1
    return table


def tiny_clip_tokenizer(model_max_length: int = 77):
    """A CLIP tokenizer whose BPE has no merges: every character is one token (514 tokens)."""
    from transformers import CLIPTokenizer

    characters = list(_byte_to_unicode().values())
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for character in characters:
        vocab[character] = len(vocab)
    for character in characters:
        vocab[character + "</w>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=model_max_length)


def tiny_t5_tokenizer(model_max_length: int = 512):
    """A T5 (Unigram) tokenizer over single ASCII characters, with and without the word-start mark.
    ids: <pad> 0, </s> 1, <unk> 2 as in T5/UMT5."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    for character in string.ascii_letters + string.digits + string.punctuation:
        pieces.append(("\u2581" + character, -3.0))
        pieces.append((character, -4.0))
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


def _clip_text_config(tokenizer, hidden_size: int, projection_dim: int | None = None):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,  # SD3 reads hidden_states[-2]
        num_attention_heads=2,
        max_position_embeddings=tokenizer.model_max_length,
        projection_dim=projection_dim if projection_dim is not None else hidden_size,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _t5_config(config_class, tokenizer, d_model: int):
    return config_class(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=8,
        d_ff=2 * d_model,
        num_layers=1,
        num_heads=d_model // 8,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )


def _image_vae(latent_channels: int, scaling_factor: float, shift_factor: float):
    """AutoencoderKL with 8x downsampling and no quant convs (the SD3/FLUX VAE layout)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=TINY_HEIGHT,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def build_tiny_sd3(num_layers: int = 2, num_attention_heads: int = 2):
    """StableDiffusion3Pipeline with tiny random components (SD3.5-Medium layout). The defaults
    are the test build (hidden width 16); larger values give the benchmarks a transformer whose
    per-call work is not dominated by op dispatch (heads of 8 channels each)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection, T5Config, T5EncoderModel

    clip_l_width, clip_g_width = 16, 24
    t5_width = 48  # >= clip_l_width + clip_g_width: the CLIP embeddings are zero-padded to it
    tokenizer, tokenizer_2, tokenizer_3 = tiny_clip_tokenizer(), tiny_clip_tokenizer(), tiny_t5_tokenizer()
    transformer = SD3Transformer2DModel(
        sample_size=TINY_HEIGHT // 8,
        patch_size=2,
        in_channels=16,
        num_layers=num_layers,
        attention_head_dim=8,
        num_attention_heads=num_attention_heads,
        joint_attention_dim=t5_width,
        caption_projection_dim=8 * num_attention_heads,  # = num_attention_heads * attention_head_dim
        pooled_projection_dim=clip_l_width + clip_g_width,
        out_channels=16,
        pos_embed_max_size=16,
        dual_attention_layers=(0,),
        qk_norm="rms_norm",
    )
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_image_vae(latent_channels=16, scaling_factor=1.5305, shift_factor=0.0609),
        text_encoder=CLIPTextModelWithProjection(_clip_text_config(tokenizer, clip_l_width)),
        tokenizer=tokenizer,
        text_encoder_2=CLIPTextModelWithProjection(_clip_text_config(tokenizer_2, clip_g_width)),
        tokenizer_2=tokenizer_2,
        text_encoder_3=T5EncoderModel(_t5_config(T5Config, tokenizer_3, t5_width)),
        tokenizer_3=tokenizer_3,
    )


def build_tiny_flux():
    """FluxPipeline with tiny random components (FLUX.1-dev layout: guidance embedding on)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5Config, T5EncoderModel

    clip_width, t5_width = 16, 32
    tokenizer, tokenizer_2 = tiny_clip_tokenizer(), tiny_t5_tokenizer()
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,  # 16 latent channels packed 2x2
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=t5_width,
        pooled_projection_dim=clip_width,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return FluxPipeline(
        scheduler=scheduler,
        vae=_image_vae(latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159),
        text_encoder=CLIPTextModel(_clip_text_config(tokenizer, clip_width)),
        tokenizer=tokenizer,
        text_encoder_2=T5EncoderModel(_t5_config(T5Config, tokenizer_2, t5_width)),
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )


def _tiny_wan_transformer(umt5_width: int, rope_max_seq_len: int = 32):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=16,
        out_channels=16,
        text_dim=umt5_width,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=rope_max_seq_len,
    )


def _tiny_wan_components(umt5_width: int) -> dict:
    """Tokenizer, UMT5 text encoder, Wan VAE and UniPC flow scheduler shared by Wan2.1 and 2.2
    (weights drawn VAE first, then the text encoder)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = tiny_t5_tokenizer()
    vae = AutoencoderKLWan(
        base_dim=4,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
    )
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=3.0,
        num_train_timesteps=1000,
    )
    return {"tokenizer": tokenizer,
            "text_encoder": UMT5EncoderModel(_t5_config(UMT5Config, tokenizer, umt5_width)),
            "vae": vae, "scheduler": scheduler}


def build_tiny_wan():
    """WanPipeline with tiny random components (Wan2.1-T2V layout, UniPC flow scheduler config)."""
    from diffusers import WanPipeline

    umt5_width = 32
    transformer = _tiny_wan_transformer(umt5_width)   # drawn first: the weights the tests know
    return WanPipeline(**_tiny_wan_components(umt5_width), transformer=transformer)


# Wan2.2-T2V-A14B's switch: the high-noise expert runs while t >= 0.875 * 1000 (model_index.json
# boundary_ratio of Wan-AI/Wan2.2-T2V-A14B-Diffusers; Wan2.2's own config: boundary 0.875).
WAN22_BOUNDARY_RATIO = 0.875


def build_tiny_wan22():
    """WanPipeline with tiny random components in the Wan2.2-T2V-A14B layout: two experts of the
    same architecture (transformer = high noise, transformer_2 = low noise, different weights)
    switched at boundary_ratio 0.875, Wan2.1's VAE and text encoder, UniPC flow scheduler with
    flow_shift 3.0 (the diffusers checkpoint's scheduler config)."""
    from diffusers import WanPipeline

    umt5_width = 32
    # rope_max_seq_len 1024 as the real experts: the tiny build can sample at WanPipeline's default
    # 480 x 832 (52 patches a row), which the Wan2.1 tiny build's 32 cannot.
    high_noise, low_noise = (_tiny_wan_transformer(umt5_width, rope_max_seq_len=1024),
                             _tiny_wan_transformer(umt5_width, rope_max_seq_len=1024))
    return WanPipeline(**_tiny_wan_components(umt5_width), transformer=high_noise,
                       transformer_2=low_noise, boundary_ratio=WAN22_BOUNDARY_RATIO)


# Wan2.2-I2V-A14B's switch (model_index.json boundary_ratio of Wan-AI/Wan2.2-I2V-A14B-Diffusers).
WAN22_I2V_BOUNDARY_RATIO = 0.9


def _tiny_wan_i2v_transformer(umt5_width: int, image_dim: int | None, rope_max_seq_len: int = 32,
                              in_channels: int = 36):
    """The tiny Wan transformer in the I2V layout: 36 input channels (latents 16, first-frame
    mask 4, condition latents 16; TI2V-5B: the 16 latents alone), 16 output channels; with
    ``image_dim`` (Wan2.1 I2V) the CLIP image projection and the added key/value projections of
    every cross-attention."""
    from diffusers import WanTransformer3DModel

    base = {key: value for key, value in _tiny_wan_transformer(umt5_width, rope_max_seq_len).config.items()
            if not key.startswith("_")}   # diffusers' bookkeeping (_use_default_values) would undo the changes
    inner_dim = base["num_attention_heads"] * base["attention_head_dim"]
    return WanTransformer3DModel.from_config({
        **base, "in_channels": in_channels, "out_channels": 16, "image_dim": image_dim,
        "added_kv_proj_dim": inner_dim if image_dim is not None else None})


def build_tiny_wan_i2v():
    """WanImageToVideoPipeline with tiny random components in the Wan2.1-I2V layout: the I2V
    transformer (36 input channels, CLIP image cross-attention), a 2-layer CLIP vision encoder
    on 32 px crops (its penultimate hidden states feed the transformer) and its image processor,
    Wan2.1's VAE, text encoder and UniPC flow scheduler."""
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    umt5_width, clip_width = 32, 16
    transformer = _tiny_wan_i2v_transformer(umt5_width, image_dim=clip_width)
    image_encoder = CLIPVisionModel(CLIPVisionConfig(
        hidden_size=clip_width, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        image_size=32, patch_size=8, projection_dim=clip_width))
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32},
                                         crop_size={"height": 32, "width": 32})
    return WanImageToVideoPipeline(**_tiny_wan_components(umt5_width), transformer=transformer,
                                   image_encoder=image_encoder, image_processor=image_processor)


def build_tiny_wan22_i2v():
    """WanImageToVideoPipeline in the Wan2.2-I2V-A14B layout: two I2V experts (transformer =
    high noise, transformer_2 = low noise) without CLIP image conditioning, switched at
    boundary_ratio 0.9, no image encoder; Wan2.1's VAE, text encoder and scheduler."""
    from diffusers import WanImageToVideoPipeline

    umt5_width = 32
    high_noise, low_noise = (_tiny_wan_i2v_transformer(umt5_width, image_dim=None),
                             _tiny_wan_i2v_transformer(umt5_width, image_dim=None))
    return WanImageToVideoPipeline(**_tiny_wan_components(umt5_width), transformer=high_noise,
                                   transformer_2=low_noise, boundary_ratio=WAN22_I2V_BOUNDARY_RATIO)


def build_tiny_wan22_ti2v():
    """WanImageToVideoPipeline in the Wan2.2-TI2V-5B layout (``expand_timesteps``): one
    transformer on the latents alone (the first frame replaced by the condition), the Wan2.2 VAE
    (residual, pixels patchified 2 x 2 before the encoder: 16x spatial compression, 4x temporal;
    16 latent channels here, 48 in the release), no image encoder, a UniPC flow scheduler with
    TI2V-5B's flow_shift 5.0. Heights and widths are multiples of 16 x patch 2 = 32."""
    from diffusers import AutoencoderKLWan, WanImageToVideoPipeline

    umt5_width = 32
    transformer = _tiny_wan_i2v_transformer(umt5_width, image_dim=None, in_channels=16)
    components = _tiny_wan_components(umt5_width)
    components["vae"] = AutoencoderKLWan(
        base_dim=4, decoder_base_dim=4, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
        out_channels=12, patch_size=2, scale_factor_spatial=16)
    components["scheduler"] = type(components["scheduler"]).from_config(
        components["scheduler"].config, flow_shift=5.0)
    return WanImageToVideoPipeline(**components, transformer=transformer, expand_timesteps=True)


_LLAMA3_SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                          "<|end_header_id|>", "<|eot_id|>")
# Llama-3's pre-tokenisation regex (its tokenizer.json): letters with one leading non-letter,
# digits in threes, punctuation runs, newline runs, spaces.
_LLAMA3_SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                         r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
HUNYUAN_VIDEO_TEMPLATE_PREFIX_TOKENS = 95   # DEFAULT_PROMPT_TEMPLATE["crop_start"]


def tiny_llama3_tokenizer(model_max_length: int = 4096):
    """A Llama-3 style byte-level BPE tokenizer (PreTrainedTokenizerFast, Llama-3's split regex,
    <|begin_of_text|> prepended, padding with <|end_of_text|>): every byte is a token, plus one
    merged token per pre-token of HunyuanVideo's prompt template, so that the template before
    the prompt is 95 tokens as with Llama-3's own vocabulary (HunyuanVideoPipeline drops
    crop_start = 95 tokens by count)."""
    import re

    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_LLAMA3_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    vocab: dict[str, int] = {token: i for i, token in enumerate(_LLAMA3_SPECIAL_TOKENS)}
    for character in _byte_to_unicode().values():
        vocab[character] = len(vocab)
    merges: list[tuple[str, str]] = []
    template = DEFAULT_PROMPT_TEMPLATE["template"].replace("{}", "")
    for chunk in re.split(r"(<\|[a-z_]+\|>)", template):
        if not chunk or chunk in _LLAMA3_SPECIAL_TOKENS:
            continue
        for word, _ in pre_tokenizer.pre_tokenize_str(chunk):
            for end in range(2, len(word) + 1):
                if word[:end] not in vocab:
                    vocab[word[:end]] = len(vocab)
                    merges.append((word[:end - 1], word[end - 1]))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", 0)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
        pad_token="<|end_of_text|>", additional_special_tokens=list(_LLAMA3_SPECIAL_TOKENS[2:]),
        model_max_length=model_max_length)


def build_tiny_hunyuan_video():
    """HunyuanVideoPipeline with tiny random components (HunyuanVideo layout: a 3-layer Llama text
    encoder whose third-to-last hidden states the pipeline reads, behind the tiny Llama-3 tokenizer
    with the 95-token template prefix; a CLIP text model whose pooled output is the transformer's
    pooled projection; the transformer's token refiner, double and single blocks, guidance
    embedding and 3-axis RoPE; the 4x temporal / 8x spatial causal VAE; a static-shift flow
    scheduler with shift 7, as hunyuanvideo-community/HunyuanVideo ships)."""
    from diffusers import (AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler,
                           HunyuanVideoPipeline, HunyuanVideoTransformer3DModel)
    from transformers import CLIPTextModel, LlamaConfig, LlamaModel

    llama_width, clip_width = 32, 16
    transformer = HunyuanVideoTransformer3DModel(
        in_channels=16, out_channels=16, num_attention_heads=2, attention_head_dim=16,
        num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1,
        guidance_embeds=True, text_embed_dim=llama_width, pooled_projection_dim=clip_width,
        rope_axes_dim=(4, 6, 6))   # sums to the head width 16, as (16, 56, 56) sums to 128
    tokenizer = tiny_llama3_tokenizer()
    special = {token: tokenizer.convert_tokens_to_ids(token) for token in _LLAMA3_SPECIAL_TOKENS}
    text_encoder = LlamaModel(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=llama_width, intermediate_size=2 * llama_width,
        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        max_position_embeddings=tokenizer.model_max_length,
        bos_token_id=special["<|begin_of_text|>"], eos_token_id=special["<|end_of_text|>"],
        pad_token_id=special["<|end_of_text|>"])).eval()
    tokenizer_2 = tiny_clip_tokenizer()
    text_encoder_2 = CLIPTextModel(_clip_text_config(tokenizer_2, clip_width)).eval()
    vae = AutoencoderKLHunyuanVideo(
        latent_channels=16, block_out_channels=(8, 8, 16, 16), layers_per_block=1,
        norm_num_groups=4, mid_block_add_attention=False)
    return HunyuanVideoPipeline(
        text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=7.0),
        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2)


# Gemma's special tokens (padding, end, begin, unknown, mask, then the image markers Gemma-3's
# vision path refers to), ids 0.. as in Gemma's own vocabulary.
_GEMMA_SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_image>",
                         "<end_of_image>", "<image_soft_token>")


def tiny_gemma_tokenizer(model_max_length: int = 1024):
    """A Gemma tokenizer (``GemmaTokenizer``: BPE with byte fallback, spaces as "\u2581", <bos>
    prepended) whose vocabulary is the special tokens, the 256 byte-fallback tokens and one token
    per printable ASCII character and the space mark, without merges."""
    from transformers import GemmaTokenizer

    vocab = {token: i for i, token in enumerate(_GEMMA_SPECIAL_TOKENS)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for character in "\u2581" + "".join(chr(code) for code in range(33, 127)):
        vocab.setdefault(character, len(vocab))
    return GemmaTokenizer(vocab=vocab, merges=[], add_bos_token=True,
                          additional_special_tokens=list(_GEMMA_SPECIAL_TOKENS[5:]),
                          model_max_length=model_max_length)


def build_tiny_ltx2():
    """LTX2Pipeline with tiny random components (LTX-2 layout: a real Gemma-3
    ``Gemma3ForConditionalGeneration``, 2 layers of width 32 and a one-layer vision tower, behind
    the tiny Gemma tokenizer; the text connectors of both streams; the audio+video transformer
    with its cross-modal attention, split RoPE; the video VAE patchifying 2 x 2 pixels (as
    LTX-2's patchifies 4 x 4) with one scaling block: 4x spatial / 2x temporal, so 32 px x 5
    frames is an 8 x 8 x 3 latent grid of 192 tokens; the audio VAE (8 mel bins, 2 latent
    channels: audio tokens 2 x 2 = 4 wide like the 4-channel video tokens) and vocoder; both
    VAEs with per-channel latent statistics away from the identity; LTX-2's dynamic-shift
    scheduler config (0.95..2.05 over 1024..4096 tokens, shift_terminal 0.1)."""
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video,
                           FlowMatchEulerDiscreteScheduler, LTX2Pipeline, LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tokenizer = tiny_gemma_tokenizer()
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in _GEMMA_SPECIAL_TOKENS}
    gemma_width, gemma_layers = 32, 2
    text_encoder = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": gemma_width, "intermediate_size": 2 * gemma_width,
            "num_hidden_layers": gemma_layers, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 16, "max_position_embeddings": tokenizer.model_max_length, "sliding_window": 8,
            "pad_token_id": ids["<pad>"], "bos_token_id": ids["<bos>"], "eos_token_id": ids["<eos>"]},
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
        mm_tokens_per_image=4, boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"], image_token_index=ids["<image_soft_token>"])).eval()
    transformer = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2,
        attention_head_dim=8, cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4,
        audio_num_attention_heads=2, audio_attention_head_dim=4, audio_cross_attention_dim=8,
        num_layers=2, caption_channels=gemma_width, rope_double_precision=False, rope_type="split",
        vae_scale_factors=(2, 4, 4))
    connectors = LTX2TextConnectors(
        caption_channels=gemma_width, text_proj_in_factor=gemma_layers + 1,
        video_connector_num_attention_heads=4, video_connector_attention_head_dim=8,
        video_connector_num_layers=1, video_connector_num_learnable_registers=None,
        audio_connector_num_attention_heads=4, audio_connector_attention_head_dim=8,
        audio_connector_num_layers=1, audio_connector_num_learnable_registers=None,
        connector_rope_base_seq_len=32, rope_theta=10000.0, rope_double_precision=False,
        causal_temporal_positioning=False, rope_type="split")
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,),
        decoder_block_out_channels=(8,), layers_per_block=(1,), decoder_layers_per_block=(1, 1),
        spatio_temporal_scaling=(True,), decoder_spatio_temporal_scaling=(True,),
        decoder_inject_noise=(False, False), downsample_type=("spatial",), upsample_residual=(False,),
        upsample_factor=(1,), timestep_conditioning=False, patch_size=2, patch_size_t=1,
        encoder_causal=True, decoder_causal=False)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None,
        in_channels=2, resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height",
        dropout=0.0, mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160,
        is_causal=True, mel_bins=8)
    with torch.no_grad():   # latent statistics away from (0, 1), so that un-normalising is tested
        for part in (vae, audio_vae):
            part.latents_mean.copy_(0.3 * torch.randn(part.latents_mean.shape))
            part.latents_std.copy_(0.5 + torch.rand(part.latents_std.shape))
    vocoder = LTX2Vocoder(
        in_channels=audio_vae.config.output_channels * audio_vae.config.mel_bins, hidden_channels=32,
        out_channels=2, upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2], resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]], leaky_relu_negative_slope=0.1, output_sampling_rate=16000)
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
        max_image_seq_len=4096, shift_terminal=0.1, time_shift_type="exponential")
    return LTX2Pipeline(scheduler=scheduler, vae=vae, audio_vae=audio_vae, text_encoder=text_encoder,
                        tokenizer=tokenizer, connectors=connectors, transformer=transformer,
                        vocoder=vocoder)


# Qwen-Image's prompt template splits into these words with Qwen's tokenizer; giving the tiny BPE
# one token per word reproduces its 34-token template prefix (QwenImagePipeline drops it by count).
_QWEN_TEMPLATE_WORDS = ("system", "user", "Describe") + tuple(
    "\u0120" + word for word in ("the image by detailing color shape size texture quantity text "
                                 "spatial relationships of objects and background").split())
_QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                        "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
QWEN_TEMPLATE_PREFIX_TOKENS = 34   # QwenImagePipeline.prompt_template_encode_start_idx


def tiny_qwen2_tokenizer(model_max_length: int = 2048):
    """A Qwen2 byte-level BPE tokenizer: every byte is a token, plus one merged token per word of
    Qwen-Image's prompt template (merges build each word left to right), and Qwen's chat and
    vision special tokens. Pre-tokenisation (Qwen2's regex, byte level) is the real one."""
    from transformers import Qwen2Tokenizer

    vocab: dict[str, int] = {}
    for character in _byte_to_unicode().values():
        vocab[character] = len(vocab)
    merges: list[tuple[str, str]] = []
    for word in _QWEN_TEMPLATE_WORDS:
        for end in range(2, len(word) + 1):
            if word[:end] not in vocab:
                vocab[word[:end]] = len(vocab)
                merges.append((word[:end - 1], word[end - 1]))
    for token in _QWEN_SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    return Qwen2Tokenizer(vocab=vocab, merges=merges,
                          additional_special_tokens=list(_QWEN_SPECIAL_TOKENS[1:]),
                          model_max_length=model_max_length)


def _tiny_qwen2_5_vl(tokenizer, hidden_size: int):
    """Qwen2_5_VLForConditionalGeneration: 2 decoder layers of width ``hidden_size`` (head 16, the
    multimodal RoPE split 2/3/3 of its 8 frequencies as 16/24/24 of 64 in Qwen2.5-VL-7B) and a
    one-block vision tower; special-token ids point into the tiny vocabulary."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in _QWEN_SPECIAL_TOKENS}
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": hidden_size, "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": 2, "num_attention_heads": hidden_size // 16, "num_key_value_heads": 1,
            "head_dim": 16, "max_position_embeddings": tokenizer.model_max_length,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
            "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                       "out_hidden_size": hidden_size, "fullatt_block_indexes": [0], "window_size": 28},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def build_tiny_qwen_image():
    """QwenImagePipeline with tiny random components (Qwen-Image layout: 16 latent channels packed
    2x2 into 64, Qwen2.5-VL text of the joint attention width, 8x VAE, Qwen-Image's scheduler config)."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)

    text_width = 32
    tokenizer = tiny_qwen2_tokenizer()
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=64,   # 16 latent channels packed 2x2
        out_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=text_width,
        axes_dims_rope=(4, 6, 6),   # sums to attention_head_dim, as (16, 56, 56) sums to 128
    )
    vae = AutoencoderKLQwenImage(base_dim=4, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                 temperal_downsample=[False, True, True])
    # Qwen/Qwen-Image's scheduler/scheduler_config.json (values as published in third-party
    # copies of it; the adapter reads whatever the checkpoint ships).
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
    return QwenImagePipeline(scheduler=scheduler, vae=vae,
                             text_encoder=_tiny_qwen2_5_vl(tokenizer, text_width),
                             tokenizer=tokenizer, transformer=transformer)


def tiny_qwen2_vl_processor(tokenizer):
    """Qwen2VLProcessor over the tiny tokenizer; its image processor keeps images small (at most
    64 patches of 28 px) so the tiny vision tower stays cheap."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    return Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=4 * 28 * 28,
                                                                  max_pixels=64 * 28 * 28),
                            tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor())


def build_tiny_qwen_image_edit():
    """QwenImageEditPipeline with the tiny Qwen-Image components plus a processor (the text
    encoder's vision tower reads the source image)."""
    from diffusers import QwenImageEditPipeline

    base = build_tiny_qwen_image()
    return QwenImageEditPipeline(processor=tiny_qwen2_vl_processor(base.tokenizer),
                                 **base.components)


def build_tiny_qwen_image_edit_plus():
    """QwenImageEditPlusPipeline (Qwen-Image-Edit-2509's layout: several source images) with
    the tiny Qwen-Image-Edit components; Qwen-Image-Edit-2511 is the same folder with the
    transformer config's ``zero_cond_t`` set (no extra weights)."""
    from diffusers import QwenImageEditPlusPipeline

    return QwenImageEditPlusPipeline(**build_tiny_qwen_image_edit().components)


def build_tiny_flux_kontext():
    """FluxKontextPipeline with the tiny FLUX.1 components (Kontext has FLUX.1-dev's layout)."""
    from diffusers import FluxKontextPipeline

    flux = build_tiny_flux()
    return FluxKontextPipeline(**{k: v for k, v in flux.components.items()
                                  if k not in ("image_encoder", "feature_extractor")})


# Qwen3's chat template, reduced to what Flux2KleinPipeline sends (one user turn, the generation
# prompt, thinking switched off: Qwen3's empty think block).
# (No "{%-" after a newline: it would strip the newline Qwen3's own template keeps.)
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}")
# Flux2KleinPipeline reads the hidden states after Qwen3 layers 9, 18 and 27.
FLUX2_KLEIN_TEXT_LAYERS = 27


def build_tiny_flux2():
    """Flux2KleinPipeline with tiny random components (FLUX.2-klein-base layout: no guidance
    embedding, is_distilled false so CFG runs; a 27-layer Qwen3 of width 16, so that the
    pipeline's layers 9/18/27 exist, feeding 3 x 16 = joint_attention_dim; the 8x FLUX.2 VAE with
    batch-norm statistics; FLUX.2's dynamic-shift scheduler config)."""
    from diffusers import (AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline,
                           Flux2Transformer2DModel)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    text_width, latent_channels = 16, 8
    tokenizer = tiny_qwen2_tokenizer(model_max_length=512)
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    text_encoder = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=text_width, intermediate_size=2 * text_width,
        num_hidden_layers=FLUX2_KLEIN_TEXT_LAYERS, num_attention_heads=2, num_key_value_heads=1,
        head_dim=8, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=pad, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=pad)).eval()
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * latent_channels, num_layers=1, num_single_layers=2,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=3 * text_width,
        timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False)
    vae = AutoencoderKLFlux2(block_out_channels=(8, 8, 16, 16), layers_per_block=1,
                             latent_channels=latent_channels, norm_num_groups=4,
                             sample_size=TINY_HEIGHT)
    with torch.no_grad():   # batch-norm statistics that are not the identity
        vae.bn.running_mean.uniform_(-0.5, 0.5)
        vae.bn.running_var.uniform_(0.5, 2.0)
    # FLUX.2's scheduler config (dynamic shifting with mu given by the pipeline).
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0,
                                                use_dynamic_shifting=True, time_shift_type="exponential")
    return Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                              tokenizer=tokenizer, transformer=transformer, is_distilled=False)


def build_tiny_z_image():
    """ZImagePipeline with tiny random components (Z-Image layout: 16 latent channels patchified
    2x2 by the transformer, main layers and both refiners, 3-axis RoPE; a Qwen3 text encoder of
    the transformer's cap_feat_dim, whose second-to-last hidden states the pipeline reads; the
    tiny Qwen2 tokenizer with Qwen3's chat template; FLUX.1's VAE layout and factors;
    Z-Image-Turbo's scheduler config)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    text_width = 32
    tokenizer = tiny_qwen2_tokenizer()
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    text_encoder = Qwen3Model(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=text_width, intermediate_size=2 * text_width,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        max_position_embeddings=tokenizer.model_max_length, bos_token_id=pad,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=pad)).eval()
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2,
        n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=text_width,
        axes_dims=[4, 6, 6])   # sums to the head width 16, as (32, 48, 48) sums to 128
    # Tongyi-MAI/Z-Image-Turbo's scheduler/scheduler_config.json (as published in third-party
    # copies of it): a static shift of 3, no dynamic shifting.
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0,
                                                use_dynamic_shifting=False)
    return ZImagePipeline(scheduler=scheduler, vae=_image_vae(16, 0.3611, 0.1159),
                          text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)


_MISTRAL_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]",
                           "[/SYSTEM_PROMPT]", "[IMG]", "[IMG_BREAK]", "[IMG_END]")
# Mistral-Small-3's chat template, reduced to what Flux2Pipeline sends: a system turn and user
# turns whose content is a list of text (and image) blocks.
MISTRAL3_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}[SYSTEM_PROMPT]{%- else %}[INST]{%- endif %}"
    "{%- for block in message['content'] %}{%- if block['type'] == 'text' %}{{ block['text'] }}"
    "{%- else %}[IMG]{%- endif %}{%- endfor %}"
    "{%- if message['role'] == 'system' %}[/SYSTEM_PROMPT]{%- else %}[/INST]{%- endif %}"
    "{%- endfor %}")
# Flux2Pipeline reads the hidden states after Mistral layers 10, 20 and 30.
FLUX2_DEV_TEXT_LAYERS = 30


def tiny_mistral3_processor(model_max_length: int = 512):
    """PixtralProcessor over a byte-level BPE tokenizer (every byte a token, one merged token per
    word of FLUX.2's system message so that it stays short) with Mistral's special tokens, and a
    small Pixtral image processor."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PixtralImageProcessor, PixtralProcessor, PreTrainedTokenizerFast

    vocab: dict[str, int] = {token: i for i, token in enumerate(_MISTRAL_SPECIAL_TOKENS)}
    for character in _byte_to_unicode().values():
        vocab[character] = len(vocab)
    byte_of = _byte_to_unicode()
    merges: list[tuple[str, str]] = []
    for word in sorted(set(SYSTEM_MESSAGE.split())):
        word = "".join(byte_of[b] for b in (" " + word).encode())
        for end in range(2, len(word) + 1):
            if word[:end] not in vocab:
                vocab[word[:end]] = len(vocab)
                merges.append((word[:end - 1], word[end - 1]))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>", additional_special_tokens=list(_MISTRAL_SPECIAL_TOKENS[4:]),
        model_max_length=model_max_length)
    image_processor = PixtralImageProcessor(size={"longest_edge": 64}, patch_size={"height": 16, "width": 16})
    return PixtralProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=16,
                            spatial_merge_size=2, chat_template=MISTRAL3_CHAT_TEMPLATE)


def build_tiny_flux2_dev():
    """Flux2Pipeline with tiny random components (FLUX.2-dev layout: guidance embedding on; a
    Mistral3ForConditionalGeneration with a 30-layer language model of width 16, so that the
    pipeline's layers 10/20/30 exist, and a one-layer Pixtral vision tower; the FLUX.2 klein
    build's VAE, scheduler and transformer shape)."""
    from diffusers import Flux2Pipeline, Flux2Transformer2DModel
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    text_width = 16
    klein = build_tiny_flux2()
    processor = tiny_mistral3_processor()
    tokenizer = processor.tokenizer
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in _MISTRAL_SPECIAL_TOKENS}
    text_encoder = Mistral3ForConditionalGeneration(Mistral3Config(
        text_config={"model_type": "mistral", "vocab_size": len(tokenizer), "hidden_size": text_width,
                     "intermediate_size": 2 * text_width, "num_hidden_layers": FLUX2_DEV_TEXT_LAYERS,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
                     "max_position_embeddings": 512, "bos_token_id": ids["<s>"],
                     "eos_token_id": ids["</s>"], "pad_token_id": ids["<pad>"]},
        vision_config={"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 32,
                       "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 8,
                       "image_size": 64, "patch_size": 16},
        image_token_index=ids["[IMG]"], spatial_merge_size=2)).eval()
    config = dict(klein.transformer.config)
    transformer = Flux2Transformer2DModel(**{**{k: v for k, v in config.items() if not k.startswith("_")},
                                             "guidance_embeds": True})
    return Flux2Pipeline(scheduler=klein.scheduler, vae=klein.vae, text_encoder=text_encoder,
                         tokenizer=processor, transformer=transformer)


_BUILDERS = {"sd3": build_tiny_sd3, "flux": build_tiny_flux, "wan": build_tiny_wan,
             "wan22": build_tiny_wan22, "qwen_image": build_tiny_qwen_image,
             "flux_kontext": build_tiny_flux_kontext, "qwen_image_edit": build_tiny_qwen_image_edit,
             "qwen_image_edit_plus": build_tiny_qwen_image_edit_plus,
             "flux2": build_tiny_flux2, "flux2_dev": build_tiny_flux2_dev,
             "wan_i2v": build_tiny_wan_i2v, "wan22_i2v": build_tiny_wan22_i2v,
             "wan22_ti2v": build_tiny_wan22_ti2v,
             "z_image": build_tiny_z_image, "hunyuan_video": build_tiny_hunyuan_video,
             "ltx2": build_tiny_ltx2}


def build_tiny(family: str, seed: int = 0, transformer_size: tuple[int, int] | None = None):
    """The tiny stock diffusers pipeline of ``family`` with weights drawn from ``seed``.
    ``transformer_size`` = (num_layers, num_attention_heads) of the transformer, sd3 only (None:
    the test build's (2, 2)). The global RNG state is left as it was."""
    if family not in _BUILDERS:
        raise ValueError(f"family must be one of {sorted(_BUILDERS)} (got {family!r})")
    if transformer_size is not None and family != "sd3":
        raise ValueError(f"transformer_size is only supported for the sd3 tiny build (got family "
                         f"{family!r}); leave it None")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pipeline = _BUILDERS[family](*(transformer_size or ()))
    return pipeline


def save_tiny(family: str, directory: str | os.PathLike, seed: int = 0,
              transformer_size: tuple[int, int] | None = None) -> str:
    """Write a tiny random ``family`` pipeline folder (model_index.json, one subfolder per component:
    weights, configs, scheduler and tokenizers) to ``directory`` and return its path.
    ``transformer_size``: see ``build_tiny``."""
    pipeline = build_tiny(family, seed=seed, transformer_size=transformer_size)
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    pipeline.save_pretrained(directory)
    return directory
