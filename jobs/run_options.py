"""The options of `fleetgen run`: one per `JobConfig` setting, grouped as the help shows them
(generation settings are part of the job's fingerprint; execution settings may change between a
run and its resume). docs/reference/options.md is rendered from them (fleetgen/jobs/reference.py)."""

from __future__ import annotations

import argparse


def add_run_options(p: argparse.ArgumentParser) -> None:
    """Every option of `fleetgen run` (and `calibrate`). Every default is None: unset options fall
    through to `--config`, then to JobConfig's defaults."""
    for group in (_job, _generation, _synthesis, _execution):
        group(p)


def _job(p: argparse.ArgumentParser) -> None:
    """What the job reads, writes and loads."""
    g = p.add_argument_group("job")
    g.add_argument("--input", help="Parquet file, directory or glob (any fsspec URL)")
    g.add_argument("--output", help="output location (any fsspec URL)")
    g.add_argument("--model", help="pipeline directory or hub id")
    g.add_argument("--config", help="TOML file with the same settings (command line wins)")
    g.add_argument(
        "--revision",
        help="hub model: branch, tag or commit (default main, resolved once to a commit and "
        "pinned in job.json so workers and resumes use the same weights)",
    )
    g.add_argument("--variant", help="weights variant, e.g. fp16 (loads *.fp16.safetensors)")
    g.add_argument(
        "--family",
        help="the model's entry in the family table (docs/reference/families.md), where the checkpoint does not say, e.g. "
        "z-image for the base model (default: detected from model_index.json, the transformer's config, the name)",
    )


def _generation(p: argparse.ArgumentParser) -> None:
    """What every image is made with: part of the job's fingerprint."""
    g = p.add_argument_group("generation (part of the job fingerprint)")
    g.add_argument(
        "--steps", type=int, help="denoising steps (default: the model family's, e.g. 30 for SD, 28 for FLUX.1-dev)"
    )
    g.add_argument(
        "--guidance",
        type=float,
        help="guidance scale (default: the model family's, e.g. 7.5 for SD, 3.5 for FLUX.1-dev)",
    )
    g.add_argument(
        "--true-cfg-scale",
        type=float,
        help="Flux: apply negative prompts with true CFG at this scale (> 1; doubles the compute)",
    )
    g.add_argument(
        "--quantize",
        help="none (default), auto (each worker's planner may quantize where that is faster or the only fit), or "
        "a format per component, e.g. transformer=fp8,text_encoder=int8 (fp8, int8, nf4, bnb-int8, gguf:PATH); "
        "changes pixels",
    )
    g.add_argument(
        "--cache",
        help="step cache on the denoiser: none (default), first-block[:THRESHOLD] (skip the other blocks while "
        "the first one's output changes less than THRESHOLD, default 0.05; one image per call) or "
        "taylorseer[:interval=N,warmup=W,order=K] (compute every N-th step, predict the rest) or "
        "magcache[:threshold=T,max_skip=K,retention=R] (FLUX.1: skip whole steps by its published ratios); "
        "changes pixels",
    )
    g.add_argument(
        "--attention",
        help="attention kernel of the denoiser: native (default: torch SDPA), auto (each worker measures the exact "
        "kernels it has and keeps the fastest), or a diffusers backend (flash, _flash_3, _native_cudnn, xformers, "
        "...; an exact one may differ per worker, sage changes pixels and is the job's)",
    )
    _task(g)
    _media(g)


def _task(g) -> None:
    """What the model does with each row, and how its input images are taken and kept."""
    from fleetgen.workers.families.table import TASKS
    from fleetgen.workers.rows.inputs import RESIZE_RULES

    g.add_argument(
        "--task",
        choices=TASKS,
        help="what the model does with each row (default: what its pipeline class does); e.g. "
        "`--task image-to-image` or `--task inpaint` on an SD directory (its weights serve both)",
    )
    g.add_argument(
        "--strength",
        type=float,
        help="image-to-image, inpaint: how far from the input, 0 to 1 (default: the task's, e.g. 0.8 for SD "
        "img2img); a `strength` column sets it per row",
    )
    g.add_argument(
        "--resize",
        choices=RESIZE_RULES,
        help="how an input image becomes the image's size: crop (default: scale to cover, cut the middle), "
        "pad (scale to fit, pad black), fit (scale to the size, aspect or not)",
    )
    g.add_argument(
        "--store-inputs",
        action="store_true",
        default=None,
        help="webdataset/parquet output: carry each image's input beside it (<id>.input.png; an "
        "`input_image` column), for before/after datasets",
    )
    g.add_argument(
        "--store-frames",
        action="store_true",
        default=None,
        help="video tasks: store every frame of a clip as a PNG beside it (<id>.frame-0000.png ...; parquet: a "
        "`frames` column), lossless, for datasets that train on frames",
    )


def _media(g) -> None:
    """The picture's size, its stored encoding, the identity columns and the shard size."""
    g.add_argument("--width", type=int, help="pixels, multiple of 8 (default 512; video families: their card's)")
    g.add_argument("--height", type=int, help="pixels, multiple of 8 (default 512; video families: their card's)")
    g.add_argument("--seed", type=int, help="job seed (default 0)")
    g.add_argument("--image-format", choices=["png", "jpeg", "webp"], help="default png")
    from fleetgen.workers.output.video import VIDEO_FORMATS

    g.add_argument(
        "--num-frames",
        type=int,
        help="video tasks: frames per clip (default: the family's, e.g. 81 for Wan, which makes 4k+1); "
        "a `num_frames` column sets it per row",
    )
    g.add_argument(
        "--fps",
        type=float,
        help="video tasks: frames per second of the stored clip (default: the family's, e.g. 16 for Wan); an "
        "`fps` column sets it per row",
    )
    g.add_argument(
        "--video-format", choices=list(VIDEO_FORMATS), help="video tasks: mp4 (H.264, yuv420p; default) or webm (AV1)"
    )
    g.add_argument("--crf", type=int, help="video tasks: the encoder's quality, 0 (lossless) to 51; default 18")
    from fleetgen.workers.output.formats import FORMATS, format_names

    g.add_argument(
        "--output-format",
        choices=format_names(),
        help="default files; " + "; ".join(f"{name}: {FORMATS[name].description}" for name in format_names()),
    )
    g.add_argument("--prompt-column", help="default prompt")
    g.add_argument("--id-column", help="default id (used when present)")
    g.add_argument("--seed-column", help="default seed (used when present)")
    g.add_argument("--negative-prompt-column", help="default negative_prompt (used when present)")
    g.add_argument("--rows-per-shard", type=int, help="rows per shard (default 256)")


def _synthesis(p: argparse.ArgumentParser) -> None:
    """Dataset synthesis: prompts from columns, several images per row, adapters, carried columns."""
    g = p.add_argument_group("dataset synthesis (part of the job fingerprint)")
    g.add_argument(
        "--prompt-template",
        help="build each prompt from columns, e.g. 'a {style} photo of a {label}' "
        "(the manifest keeps the rendered prompt and the template)",
    )
    g.add_argument(
        "--images-per-prompt",
        type=int,
        help="images per row (default 1); ids become <id>-<k>, each with "
        "its own stable seed; a `num_images` column overrides it per row",
    )
    g.add_argument(
        "--lora",
        action="append",
        metavar="PATH_OR_ID[:SCALE]",
        help="a LoRA adapter on every image (repeatable); a row's `lora` column replaces them for that row",
    )
    g.add_argument(
        "--keep-columns",
        help="carry only these input columns into the outputs, e.g. label,style (default: every column)",
    )
    g.add_argument("--drop-columns", help="carry every input column but these")
    from fleetgen.scores import SCORERS

    g.add_argument(
        "--score",
        metavar="NAME[=MODEL],...",
        help="score every image on its worker right after decoding, into `score_<name>` fields: "
        + "; ".join(f"{s.name} ({s.doc})" for s in SCORERS.values())
        + ". MODEL: a hub id (ORG/NAME[@REV], pinned to a commit like --model) or a local directory "
        "(default: each scorer's published model)",
    )
    g.add_argument(
        "--keep",
        metavar="RULE",
        help="store only the images whose scores pass, e.g. 'clip>=0.26 and nsfw<0.5' (the rest are `filtered` "
        "rows with their scores)",
    )
    g.add_argument(
        "--best-of",
        type=int,
        metavar="N",
        help="make N candidates per image (each its own seed) and store the best by --rank-by; every candidate's "
        "scores stay in the manifest",
    )
    g.add_argument(
        "--rank-by", metavar="NAME", help="the score --best-of ranks by, highest first (`-NAME`: lowest first)"
    )
    from fleetgen.workers.output.fields import roles

    for f in (f for f in roles() if f.setting):  # one per per-row role of the field table (workers/output/fields.py)
        g.add_argument(
            f"--{f.role.replace('_', '-')}-column",
            help=f"per-row {f.role.replace('_', ' ')} (default `{f.default_column}`, used when present; "
            "`none` to ignore it)",
        )


def _execution(p: argparse.ArgumentParser) -> None:
    """How the job runs: may change between a run and its resume."""
    g = p.add_argument_group("execution")
    g.add_argument(
        "--workers",
        "--max-workers",
        type=int,
        dest="max_workers",
        help="at most this many workers (default: locally one per GPU, else CPUs / --cpu-threads; "
        "on a cluster one per shard to do, up to 1000: the autoscaler adds nodes for them)",
    )
    g.add_argument(
        "--gpus-per-worker",
        type=float,
        help="Ray GPUs each worker asks for (default 1 for GPU workers; "
        "0.5 packs two on one GPU, each planning within its share)",
    )
    g.add_argument(
        "--placement-timeout",
        type=float,
        help="seconds to wait with no worker placed before giving up with exit 2 (default 300)",
    )
    g.add_argument("--cpu-threads", type=int, help="torch threads per CPU worker (default 1)")
    g.add_argument("--max-batch", type=int, help="images per pipeline call (default 4)")
    g.add_argument("--max-attempts", type=int, help="tries per shard (default 3)")
    g.add_argument("--max-restarts", type=int, help="restarts of a dead worker before it is dropped (default 3)")
    g.add_argument(
        "--stop-grace",
        type=float,
        help="seconds running shards get to commit after SIGTERM/SIGINT (default 0: abandon)",
    )
    _devices(g)


def _devices(g) -> None:
    """Compilation, placements, budgets, the device and the dtype; what a run may replace."""
    g.add_argument(
        "--compile",
        action="store_true",
        default=None,
        help="torch.compile each worker's denoisers (regional where they have repeated blocks; keeps pixels; "
        "compile time in workers/<w>.json)",
    )
    g.add_argument(
        "--offload",
        choices=["auto", "none", "block", "leaf", "disk"],
        help="how workers place the pipeline (default auto: planned per device)",
    )
    g.add_argument(
        "--phases",
        choices=["auto", "on", "off"],
        help="text encoders in a phase of their own, a chunk of prompts at a time, then the denoiser (default "
        "auto: where each worker's plan predicts it faster; keeps pixels)",
    )
    g.add_argument(
        "--gpu-memory",
        help="device budget per worker, e.g. 24GiB (default: free memory; "
        "on CPU workers, plan as if the device had this much)",
    )
    g.add_argument(
        "--host-memory",
        help="host RAM per worker for offloaded copies (default: the node's RAM split between its workers)",
    )
    g.add_argument("--worker-memory", help="emulate a mixed fleet: one worker per budget, e.g. 16GiB,24GiB,80GiB")
    g.add_argument(
        "--device",
        help="where workers compute: auto | cpu | cuda | cuda:N (default auto: GPU workers "
        "on a cluster or a machine with GPUs, else CPU)",
    )
    g.add_argument(
        "--dtype", help="auto | float32 | float16 | bfloat16 (default auto: the family's on CUDA, float32 on CPU)"
    )
    g.add_argument("--ray-address", help="Ray cluster to join (default RAY_ADDRESS, else start a local one)")
    g.add_argument("--overwrite", action="store_true", default=None, help="replace a different job at --output")
    g.add_argument(
        "--strict-prompts",
        action="store_true",
        default=None,
        help="a prompt longer than the text encoder takes is an error row (default: truncate, noted per row)",
    )
    g.add_argument(
        "--retry-errors",
        action="store_true",
        default=None,
        help="also redo the error rows of committed shards; their ok images are kept as they are",
    )
    g.add_argument(
        "--allow-unsafe-commits",
        action="store_true",
        default=None,
        help="run on an output store whose fsspec backend cannot create an object only if absent "
        "(local disks, s3://, gs:// and az:// can): two attempts of a shard could then both commit",
    )
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        default=None,
        help="allow the model repo to run its own code (off by default)",
    )
