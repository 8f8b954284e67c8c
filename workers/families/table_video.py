"""The video families of the family table (workers/families/table.py): Wan 2.1 / 2.2, LTX-Video,
LTX-2 (with sound), HunyuanVideo 1.5 — each with its tasks, the size, frames and frame rate of its card and its frame
rule. No torch here."""

from __future__ import annotations

from fleetgen.workers.families.entry import Family
from fleetgen.workers.families.tasks import HUNYUANVIDEO15_TASKS, LTX2_TASKS, LTX_TASKS, WAN_I2V_TASKS, WAN_TASKS

_BF16 = {"dtype": "bfloat16"}
# Wan: defaults of the cards (Wan 2.1 T2V 480p: 832x480, 81 frames at 16 fps, 50 steps, guidance 5;
# Wan 2.2 A14B: 1280x720, 40 steps, guidance 4; TI2V-5B: 1280x704, 121 frames at 24 fps). Cond and
# uncond are two transformer calls (cfg_batched False); sides are multiples of 16 (the VAE's 8 x the
# patch's 2; the pipeline refuses others).
_WAN = {
    **_BF16,
    "negative": "negative_prompt",
    "tokenizer": "tokenizer",
    "max_sequence_length": 512,
    "cfg": True,
    "cfg_batched": False,
    "size_floor": 16,
    "text_encoder": "UMT5-XXL, 512 tokens",
    "frames": 81,
    "fps": 16.0,
    "frame_step": 4,
}

# LTX-Video and LTX-2: cond and uncond in one batch, a 32x VAE, 8 frames per latent frame after the first
_LTX = {**_WAN, "cfg_batched": True, "size_floor": 32, "frame_step": 8}

VIDEO_TABLE = (
    Family(
        "wan",
        ("WanPipeline",),
        steps=50,
        guidance=5.0,
        tasks=WAN_TASKS,
        sizes=("832x480", "480x832"),
        note="Wan 2.1 text-to-video (1.3 B, 14 B): 81 frames at 16 fps",
        **_WAN,
    ),
    Family(
        "wan2.2",
        ("WanPipeline",),
        steps=40,
        guidance=4.0,
        tasks=WAN_TASKS,
        sizes=("1280x720", "720x1280"),
        note="Wan 2.2 T2V-A14B: two 14 B experts (high noise, then low noise), one live at a time",
        **_WAN,
    ),
    Family(
        "wan-ti2v",
        ("WanPipeline",),
        steps=50,
        guidance=5.0,
        tasks=WAN_TASKS,
        sizes=("1280x704", "704x1280"),
        note="Wan 2.2 TI2V-5B: 121 frames at 24 fps through a 16x VAE",
        **{**_WAN, "frames": 121, "fps": 24.0, "size_floor": 32},
    ),
    Family(
        "wan-i2v",
        ("WanImageToVideoPipeline",),
        steps=40,
        guidance=3.5,
        tasks=WAN_I2V_TASKS,
        sizes=("1280x720", "832x480"),
        note="Wan 2.1 / 2.2 image-to-video: each clip starts at its row's image",
        **_WAN,
    ),
    Family(
        "ltx-video",
        ("LTXPipeline",),
        steps=50,
        guidance=3.0,
        tasks=LTX_TASKS,
        sizes=("704x480", "480x704"),
        note="LTX-Video (2 B): 161 frames at 25 fps; image-to-video from the same weights",
        **{
            **_LTX,
            "max_sequence_length": 128,
            "text_encoder": "T5-XXL, 128 tokens",
            "frames": 161,
            "fps": 25.0,  # the pipeline's `frame_rate` (it conditions on it) and the stored clip's
        },
    ),
    Family(
        # LTX-2 (19 B): video with its sound. Defaults of diffusers' LTX2Pipeline (0.42; its example: 768x512,
        # 121 frames at 24 fps, 30 steps, guidance 3); the audio-guidance, spatio-temporal-guidance and
        # modality knobs keep the pipeline's defaults (LTX-2.3's), so every step runs the transformer on the
        # cond+uncond batch and twice more on one batch.
        "ltx-2",
        ("LTX2Pipeline",),
        steps=30,
        guidance=3.0,
        tasks=LTX2_TASKS,
        sizes=("768x512", "512x768"),
        note="LTX-2 (19 B) audio-video: 121 frames at 24 fps with a stereo 24 kHz track; image-to-video from the same weights",
        **{
            **_LTX,
            "max_sequence_length": 1024,
            "text_encoder": "Gemma 3 12B, 1024 tokens",
            "frames": 121,
            "fps": 24.0,
            "more_calls": 2,
            "audio": True,
        },
    ),
    Family(
        "hunyuanvideo-1.5",
        ("HunyuanVideo15Pipeline",),
        steps=50,
        guidance=6.0,
        negative="negative_prompt",
        cfg=True,
        cfg_batched=False,
        guidance_arg="guider",  # set on its ClassifierFreeGuidance guider, as HunyuanImage's
        tokenizer="tokenizer",
        max_sequence_length=None,  # the pipeline takes none
        size_floor=16,
        text_encoder="Qwen2.5-VL 7B, and ByT5 for quoted text",
        sizes=("848x480", "480x848"),
        tasks=HUNYUANVIDEO15_TASKS,
        frames=121,
        fps=24.0,
        frame_step=4,
        note="HunyuanVideo 1.5 (8.3 B) text-to-video: 121 frames at 24 fps (its image-to-video is another checkpoint)",
        **_BF16,
    ),
)
