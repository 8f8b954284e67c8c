"""What `make gpu-check` needs on a GPU machine that has torch and no package registry, in one
file under the 64 MiB a device session can carry: `gpu-overlay.tar.xz`.

The packages the check imports (diffusers, transformers, pyarrow, ... at the versions pinned in
this checkout's environment) are downloaded as wheels for the GPU machine's Python, installed into
`gpu-overlay/` with no dependency resolution, pruned of what the check never loads (pyarrow's
Flight, S3 and headers; hub's Xet transfer; tests and caches), and packed with xz.
Packages the machine already has are left out: `--have` (by default what the lent H200 image has:
everything but diffusers; `python3 bench/gpu_wheelhouse.py --probe` on the machine prints what it has).

On the GPU machine (no `make` needed):
    tar -xJf gpu-overlay.tar.xz && PYTHONPATH=$PWD/gpu-overlay python3 bench/gpu_check.py

    python bench/gpu_wheelhouse.py [--python 3.12] [--have torch,numpy,...] [--out gpu-overlay.tar.xz]
    python bench/gpu_wheelhouse.py --probe      # on the GPU machine: its Python, torch, and the packages it has
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

LIMIT = 64 * 2**20
# What the check imports (directly or through diffusers/transformers/huggingface_hub); their own
# dependencies are resolved by pip at the versions of this environment. accelerate: diffusers 0.42.1's
# group offloading calls its `send_to_device` (a NameError without it, found by the dry run on a
# torch-only Python).
NEEDS = [
    "diffusers",
    "accelerate",
    "transformers",
    "tokenizers",
    "safetensors",
    "huggingface_hub",
    "pyarrow",
    "fsspec",
    "numpy",
    "pillow",
    "psutil",
    "pytest",
    "regex",
    "requests",
    "pyyaml",
    "tqdm",
    "packaging",
    "filelock",
    "torchao",  # the int8 rows (`--quantize ...=int8`); pure Python for what they use
    "av",  # the Wan rows' clips (PyAV: its abi3 wheel carries FFmpeg, ~35 MB)
]
# A torch wheel brings these (and CUDA libraries): left out unless asked for.
TORCH_BRINGS = [
    "torch",
    "filelock",
    "typing_extensions",
    "fsspec",
    "jinja2",
    "markupsafe",
    "networkx",
    "sympy",
    "mpmath",
    "setuptools",
    "triton",
]
# What the lent H200 image has (its probe: Python 3.12.3, torch 2.11, transformers 5.17, accelerate
# 1.15, huggingface_hub 1.33, ... — as one cheap call there printed it): all the check needs but
# diffusers (and torchao, for the int8 rows), whose wheels need nothing the image lacks. An overlay of cp311 builds
# on its PYTHONPATH would shadow its working cp312 numpy and pyarrow.
H200_HAS = [n for n in dict.fromkeys([*NEEDS, *TORCH_BRINGS]) if n not in ("diffusers", "torchao", "av")]
# Never loaded by the check: removed from the overlay (globs under it).
PRUNE = [
    "pyarrow/libarrow_flight.so*",
    "pyarrow/_flight*.so",
    "pyarrow/libarrow_s3*.so*",
    "pyarrow/_s3fs*.so",
    "pyarrow/_substrait*.so",
    "pyarrow/libgandiva*",
    "pyarrow/_gandiva*.so",
    "pyarrow/include",
    "pyarrow/src",
    "pyarrow/tests",
    "pyarrow/*.pyx",
    "pyarrow/*.pxd",
    "pyarrow/*.pxi",
    "hf_xet",
    "hf_xet-*",
    "*/tests",
    "**/__pycache__",
    "numpy/_core/tests",
    "numpy/*/tests",
    "*.dist-info/RECORD",
]


def _key(name: str) -> str:
    return name.lower().replace("-", "_")


def probe() -> dict:
    """On the GPU machine: what is there."""
    have = {}
    for dist in importlib.metadata.distributions():
        have[_key(dist.metadata["Name"])] = dist.version
    out = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "have": {n: have.get(_key(n)) for n in sorted({*NEEDS, *TORCH_BRINGS})},
    }
    try:
        import torch

        out["torch_cuda"] = torch.version.cuda
        out["cuda_available"] = torch.cuda.is_available()
        out["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except ImportError:
        pass
    return out


def pinned(names: list[str]) -> list[str]:
    """`name==version` as installed here (so the GPU machine runs what the suite tested)."""
    out = []
    for name in names:
        try:
            out.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(name)
    return out


def build(python: str, have: list[str], out: Path) -> dict:
    have_keys = {_key(h) for h in have}
    with tempfile.TemporaryDirectory(prefix="fleetgen-wheelhouse-") as tmp:
        wheels, overlay = Path(tmp) / "wheels", Path(tmp) / "gpu-overlay"
        freeze = subprocess.run(
            [sys.executable, "-m", "pip", "freeze", "--exclude-editable"], check=True, capture_output=True, text=True
        ).stdout
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text("\n".join(line for line in freeze.splitlines() if "==" in line))
        wanted = [n for n in NEEDS if _key(n) not in have_keys]
        # Only what is missing, its dependencies being there (the H200 case: diffusers alone), or the
        # whole closure for a torch-only image.
        no_deps = ["--no-deps"] if len(wanted) < len(NEEDS) // 2 else []
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                *no_deps,
                "--only-binary=:all:",
                "--python-version",
                python,
                "--platform",
                "manylinux_2_28_x86_64",
                "--platform",
                "manylinux_2_17_x86_64",
                "--platform",
                "manylinux2014_x86_64",
                "-c",
                str(constraints),
                "-d",
                str(wheels),
                *pinned(wanted),
            ],
            check=True,
        )
        kept = [w for w in sorted(wheels.glob("*.whl")) if _key(w.name.split("-")[0]) not in have_keys]
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--no-index",
                "--no-compile",
                "--target",
                str(overlay),
                *map(str, kept),
            ],
            check=True,
        )
        for pattern in PRUNE:
            for path in overlay.glob(pattern):
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        installed = sum(p.stat().st_size for p in overlay.rglob("*") if p.is_file())
        with open(out, "wb") as f:
            tar = subprocess.Popen(["tar", "-C", tmp, "-cf", "-", "gpu-overlay"], stdout=subprocess.PIPE)
            subprocess.run(["xz", "-9", "-T0"], stdin=tar.stdout, stdout=f, check=True)
            tar.wait()
    size = out.stat().st_size
    return {
        "python": python,
        "left_out": sorted(have_keys),
        "wheels": [w.name for w in kept],
        "installed_bytes": installed,
        "archive": str(out),
        "archive_bytes": size,
        "within_limit": size <= LIMIT,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--probe", action="store_true", help="print what this machine has (run it on the GPU machine)")
    parser.add_argument("--python", default="3.12", help="the GPU machine's Python (major.minor; the lent H200: 3.12)")
    parser.add_argument(
        "--have",
        default=",".join(H200_HAS),
        help="packages the GPU machine has already (left out), comma-separated; default: what the "
        "lent H200 image has (all but diffusers, torchao and av); a torch-only image: --have " + ",".join(TORCH_BRINGS),
    )
    parser.add_argument("--out", default="gpu-overlay.tar.xz")
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe(), indent=2))
        return
    result = build(args.python, [h for h in args.have.split(",") if h], Path(args.out))
    print(json.dumps(result, indent=2))
    if not result["within_limit"]:
        sys.exit(
            f"{args.out} is {result['archive_bytes'] / 2**20:.1f} MiB, over the 64 MiB a device session carries: "
            "leave out what the GPU machine has (`--have`, see `--probe`)."
        )


if __name__ == "__main__":
    main()
