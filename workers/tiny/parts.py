"""What the tiny random-weight pipelines are built from: in-memory tokenizers (word-level and a chat
template one for the language-model encoders), CLIP, T5, ByT5 and Qwen2.5-VL text encoders, a VAE."""

from __future__ import annotations

import string

import torch

# Vocabulary: lower-case words of the sample prompts are not needed verbatim; single letters,
# digits and a few hundred common words keep the tokenizer real without shipping a vocab file.
_WORDS = (
    "a an the of in on at with and or by for from to under over near above below photo painting "
    "drawing sketch portrait landscape city forest river mountain sea sky night day sunset sunrise "
    "cat dog bird fish horse fox owl robot car train ship house tower bridge garden flower tree "
    "red orange yellow green blue purple black white gold silver small big old new bright dark "
    "watercolor oil digital pixel art style detailed minimal cinematic lighting snow rain fog desert"
).split()


def _evaluated(builder):
    """Builders return pipelines in eval mode, as `from_pretrained` does (T5's dropout is on in
    train mode: two calls with one seed would differ)."""
    import functools

    @functools.wraps(builder)
    def build(*args, **kwargs):
        pipe = builder(*args, **kwargs)
        for module in pipe.components.values():
            if isinstance(module, torch.nn.Module):
                module.eval()
        return pipe

    return build


def _tokenizer(model_max_length: int = 77):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<|startoftext|>", "<|endoftext|>", "<unk>"]
    words = specials + sorted(set(_WORDS) | set(string.ascii_lowercase) | set(string.digits))
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>",
        special_tokens=[("<|startoftext|>", vocab["<|startoftext|>"]), ("<|endoftext|>", vocab["<|endoftext|>"])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        model_max_length=model_max_length,
    )


def _clip(tokenizer, seed: int, projection: bool = False, hidden: int = 32, positions: int = 77):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    config = CLIPTextConfig(
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_attention_heads=4,
        num_hidden_layers=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=positions,
        projection_dim=32,
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)


def _t5(tokenizer, seed: int, d_model: int = 32, umt5: bool = False):
    """A tiny T5 encoder (`umt5`: UMT5, Wan's, the same shape with per-layer relative positions)."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    config, model = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    return model(
        config(
            vocab_size=len(tokenizer),
            d_model=d_model,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
            pad_token_id=1,
            eos_token_id=1,
        )
    )


def _vae(seed: int, **kw):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        block_out_channels=(32, 32),
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=32,
        sample_size=32,
        **kw,
    )


def _byt5(seed: int):
    """A tiny ByT5 encoder (HunyuanImage's and HunyuanVideo 1.5's glyph encoder; 384 byte ids)."""
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    return T5EncoderModel(
        T5Config(
            d_model=32,
            d_kv=4,
            d_ff=16,
            num_layers=2,
            num_heads=2,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=32,
            vocab_size=384,
            feed_forward_proj="gated-gelu",
            dense_act_fn="gelu_new",
            is_encoder_decoder=False,
            use_cache=False,
            tie_word_embeddings=False,
        )
    )


# A chat template for the in-memory tokenizer: the text of every message, role first, as the
# Mistral, Qwen and Llama templates render it for text-only prompts (image parts are dropped).
_CHAT = (
    "{%- for m in messages -%}{{ m['role'] }} "
    "{%- if m['content'] is string %} {{ m['content'] }}"
    "{%- else %}{%- for c in m['content'] %}{%- if c['type'] == 'text' %} {{ c['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %} {% endfor -%}"
    "{%- if add_generation_prompt %}assistant{%- endif %}"
)


def _chat_tokenizer(model_max_length: int = 512):
    tokenizer = _tokenizer(model_max_length=model_max_length)
    tokenizer.chat_template = _CHAT
    tokenizer.padding_side = "right"
    return tokenizer


def _qwen25_vl(tokenizer, seed: int, hidden: int = 16):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vocab = len(tokenizer) + 3  # the vision tokens after the text vocabulary
    q = hidden // 16  # the rotary sections of half a head (2 heads): a quarter, a quarter, a half
    torch.manual_seed(seed)
    config = Qwen2_5_VLConfig(
        text_config={
            "hidden_size": hidden,
            "intermediate_size": hidden,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "rope_scaling": {"mrope_section": [q, q, 2 * q], "rope_type": "default", "type": "default"},
            "rope_theta": 1000000.0,
            "vocab_size": vocab,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "out_hidden_size": hidden,
        },
        hidden_size=hidden,
        vocab_size=vocab,
        vision_start_token_id=vocab - 3,
        vision_end_token_id=vocab - 2,
        vision_token_id=vocab - 1,
    )
    return Qwen2_5_VLForConditionalGeneration(config)
