"""Random-weight test pipelines built from the real diffusers/transformers classes, at the sizes of
diffusers' own tests: what the demo, the tests and `fleetgen tiny-model` use (no hub access).

registry.py   every family's builder (`TINY_FAMILIES`), written as a model directory; a random LoRA;
              the shipped architectures at their real size with random weights
sd.py         SD 1.x, SDXL, SD3          flux.py   FLUX.1, FLUX.2 dev and klein, Chroma
qwen.py       Qwen-Image, Z-Image, HunyuanImage 2.1     dit.py    PixArt-Sigma, Sana, HiDream-I1
video.py      Wan 2.1/2.2, LTX-Video, LTX-2, HunyuanVideo 1.5
parts.py      tokenizers, text encoders and VAEs the builders share
"""

from fleetgen.workers.tiny.registry import (
    TINY_FAMILIES,
    build_random_pipeline,
    build_tiny_pipeline,
    write_tiny_lora,
    write_tiny_model,
)

__all__ = ["TINY_FAMILIES", "build_random_pipeline", "build_tiny_pipeline", "write_tiny_lora", "write_tiny_model"]
