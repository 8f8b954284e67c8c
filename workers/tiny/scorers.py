"""Tiny random-weight scorers of the real classes (fleetgen/scores.py): a CLIP model (`clip`,
`pickscore`), LAION's aesthetic MLP over it (`aesthetic`), and an image classifier with an `nsfw`
label (`nsfw`), each written as the directory `--score NAME=DIR` takes. Random weights make
arbitrary but deterministic scores: what the tests need to check that scores are computed, stored
and filtered on, not that they mean anything."""

from __future__ import annotations

from pathlib import Path

TINY_SCORERS = ("clip", "pickscore", "aesthetic", "nsfw")
SIDE = 32  # pixels the tiny scorers read
PROJECTION = 16  # CLIP's embedding width; the aesthetic head reads it


def write_tiny_scorer(directory: str | Path, scorer: str = "clip", seed: int = 0) -> Path:
    """Write a tiny `scorer` (TINY_SCORERS) to `directory`; returns it."""
    from transformers import CLIPImageProcessor

    from fleetgen.workers.tiny.parts import _tokenizer

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    if scorer in ("clip", "pickscore", "aesthetic"):
        _clip_model(seed).save_pretrained(out)
        _tokenizer().save_pretrained(out)
        CLIPImageProcessor(size={"shortest_edge": SIDE}, crop_size={"height": SIDE, "width": SIDE}).save_pretrained(out)
        if scorer == "aesthetic":
            from safetensors.torch import save_file

            save_file(_aesthetic_head(seed + 1), str(out / "aesthetic.safetensors"))
        return out
    if scorer == "nsfw":
        import torch
        from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

        torch.manual_seed(seed)
        config = ViTConfig(
            image_size=SIDE,
            patch_size=8,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            id2label={0: "normal", 1: "nsfw"},
            label2id={"normal": 0, "nsfw": 1},
        )
        ViTForImageClassification(config).eval().save_pretrained(out)
        ViTImageProcessor(size={"height": SIDE, "width": SIDE}).save_pretrained(out)
        return out
    raise ValueError(f"`scorer` must be one of {', '.join(TINY_SCORERS)}, got `{scorer}`.")


def _clip_model(seed: int):
    import torch
    from transformers import CLIPConfig, CLIPModel

    from fleetgen.workers.tiny.parts import _tokenizer

    torch.manual_seed(seed)
    text = {
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": len(_tokenizer()),
        "max_position_embeddings": 77,
    }
    vision = {
        "image_size": SIDE,
        "patch_size": 8,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
    }
    return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=PROJECTION)).eval()


def _aesthetic_head(seed: int) -> dict:
    """LAION's MLP layout (`layers.0`, `.2`, `.4`, `.6`, `.7`; dropout between), narrower."""
    import torch

    torch.manual_seed(seed)
    widths = [PROJECTION, 32, 16, 8, 4, 1]
    state = {}
    for index, (a, b) in zip((0, 2, 4, 6, 7), zip(widths, widths[1:], strict=False), strict=True):
        layer = torch.nn.Linear(a, b)
        state[f"layers.{index}.weight"], state[f"layers.{index}.bias"] = layer.weight.data, layer.bias.data
    return state
