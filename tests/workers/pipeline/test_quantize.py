"""Storage formats on a fitted pipeline (offload/quantize.py applied by workers/pipeline/fitted.py): the bytes
predicted, the images kept close, offloading a quantized pipeline, `auto` under a budget and after an OOM, GGUF."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from fleetgen.errors import ConfigError
from fleetgen.jobs.config import JobConfig, validate
from fleetgen.jobs.models import resolve_defaults
from fleetgen.jobs.sharding import plan_shards, read_footer, resolve_columns
from fleetgen.offload.weight_formats import parse_quantize
from fleetgen.workers.rows.shard import Columns
from fleetgen.workers.spec import GenerationSettings, WorkerSpec
from fleetgen.workers.worker import Worker
from tests.conftest import pixels, run_one_shard, write_prompts

MIN_PSNR = 30.0  # dB against the unquantized images of the same seeds (tiny SD, 4 steps: ~45 measured)


def _run(model, out, path, quantize="none", **spec):
    settings = GenerationSettings(
        task="text-to-image", steps=4, guidance=5.0, width=64, height=64, family="sd", quantize=parse_quantize(quantize)
    )
    return run_one_shard(model, out, path, settings, **{"max_batch": 1, **spec})


# (mapping, component: the measured bytes' share of float32): fp8 stores every Conv/Linear tensor in
# one byte (norms kept); int8 stores Linear weights in one byte plus 5 per row (convs, biases kept).
CASES = {
    "unet=fp8": {"unet": (0.25, 0.27)},
    "text_encoder=int8,unet=int8": {"unet": (0.70, 0.73), "text_encoder": (0.44, 0.46)},
}


def _write_gguf(model_dir: str, path) -> dict[str, int]:
    """The tiny UNet's weights as a GGUF file, Linear weights in Q8_0 (what `llama.cpp`-style tools
    write for image models, with diffusers keys); returns {tensor: stored bytes} from its header."""
    import gguf
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(model_dir, subfolder="unet")
    writer = gguf.GGUFWriter(str(path), arch="fleetgen-test")
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, tensor in unet.state_dict().items():
        array = tensor.float().numpy()
        if array.ndim == 2 and array.shape[-1] % 32 == 0:
            data = gguf.quants.quantize(array, q8)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=q8)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}


@pytest.mark.parametrize(
    "mapping", [pytest.param(m, marks=[pytest.mark.slow] if "int8" in m else []) for m in sorted(CASES)]
)
def test_a_format_holds_the_bytes_predicted_and_stays_close(mapping, tiny_model, tmp_path):
    path = write_prompts(tmp_path / "p.parquet", ["a red fox", "a blue owl"], id=["a", "b"])
    plain, plain_rows = _run(tiny_model, tmp_path / "plain", path)
    q, q_rows = _run(tiny_model, tmp_path / "q", path, mapping)
    info = json.loads((tmp_path / "q" / "workers" / "w0.json").read_text())
    formats = parse_quantize(mapping).mapping
    assert info["quantized"] == formats
    measured, unquantized = info["weight_bytes"], plain.fitted.weight_bytes  # from the live modules
    for name, fmt in formats.items():
        assert measured[name] == q.profile.variant(name, fmt).bytes  # the planner's prediction, to the byte
        low, high = CASES[mapping][name]
        assert low <= measured[name] / unquantized[name] < high, (name, measured[name] / unquantized[name])
    assert measured["vae"] == unquantized["vae"]
    for k in ("a", "b"):
        row = q_rows[k]
        assert row["status"] == "ok" and row["sha256"] != plain_rows[k]["sha256"]  # pixels change
        assert row["quantized"] == mapping and plain_rows[k]["quantized"] == "none"  # recorded per image
        mse = ((pixels(tmp_path / "plain", plain_rows[k]) - pixels(tmp_path / "q", row)) ** 2).mean()
        assert 10 * np.log10(255**2 / mse) >= MIN_PSNR


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["block", "leaf"])
@pytest.mark.parametrize("mapping", ["unet=fp8", "unet=int8"])
def test_offloading_a_quantized_pipeline_keeps_its_images(offload, mapping, tiny_model, tmp_path):
    path = write_prompts(tmp_path / "p.parquet", ["a red fox", "a blue owl"], id=["a", "b"])
    _, resident = _run(tiny_model, tmp_path / "resident", path, mapping)
    worker, offloaded = _run(tiny_model, tmp_path / "off", path, mapping, offload=offload, gpu_memory=64 << 20)
    assert worker.plan.modes["unet"] != "resident"
    assert {k: r["sha256"] for k, r in offloaded.items()} == {k: r["sha256"] for k, r in resident.items()}


@pytest.mark.slow
def test_auto_quantizes_where_the_budget_needs_it_and_records_it(tiny_model, tmp_path):
    """Tiny SD at float32 on a CPU worker planned for 20 MiB: unquantized, the UNet streams leaf by
    leaf; `auto` holds it resident in fp8 and says why. At 28 MiB everything fits unquantized and
    `auto` keeps the run dtype."""
    path = write_prompts(tmp_path / "p.parquet", ["a red fox", "a blue owl"], id=["a", "b"])
    worker, rows = _run(tiny_model, tmp_path / "tight", path, "auto", gpu_memory=20 << 20)
    assert worker.plan.formats == {"unet": "fp8"} and worker.plan.modes["unet"] == "resident"
    assert worker.plan.reason.startswith("unet fp8 resident: ") and "the best unquantized plan" in worker.plan.reason
    assert {r["quantized"] for r in rows.values()} == {"unet=fp8"} and {r["status"] for r in rows.values()} == {"ok"}
    info = json.loads((tmp_path / "tight" / "workers" / "w0.json").read_text())
    assert info["quantized"] == {"unet": "fp8"} and info["plan"]["formats"] == {"unet": "fp8"}
    roomy, rows = _run(tiny_model, tmp_path / "roomy", path, "auto", gpu_memory=28 << 20)
    assert roomy.plan.formats == {} and {r["quantized"] for r in rows.values()} == {"none"}


@pytest.mark.slow
def test_an_oom_under_auto_may_quantize_further(tiny_model, tmp_path):
    """An out-of-memory error while the UNet holds float32 weights (injected): under `auto` the
    step-down ladder may choose a format the worker can apply (kept, recorded, the images after it
    say so). Under `none` or a mapping the planner offers no other format (test_quantized_plans)."""
    import torch

    path = write_prompts(tmp_path / "p.parquet", ["a red fox"], id=["a"])

    def fail_unquantized(module, args):
        if module.conv_in.weight.dtype == torch.float32:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    files = [read_footer(str(path))]
    shard, columns = plan_shards(files, 100)[0], resolve_columns(files, Columns())
    settings = GenerationSettings(
        task="text-to-image", steps=2, guidance=5.0, width=64, height=64, family="sd", quantize=parse_quantize("auto")
    )
    spec = WorkerSpec.of("w0", tiny_model, str(tmp_path / "o"), settings, columns, device="cpu", gpu_memory=28 << 20)
    worker = Worker(spec.with_options(max_batch=1))
    assert worker.plan.formats == {}
    worker.pipe.unet.register_forward_pre_hook(fail_unquantized)
    result = worker.run_shard(shard)
    assert (result.ok, result.errors) == (1, 0)
    assert worker.fitted.quantized == {"unet": "fp8"} and worker.step_downs
    row = pq.read_table(tmp_path / "o" / "shards").to_pylist()[0]
    assert row["quantized"] == "unet=fp8"
    info = json.loads((tmp_path / "o" / "workers" / "w0.json").read_text())
    assert info["quantized"] == {"unet": "fp8"} and info["plan"]["formats"] == {"unet": "fp8"}


@pytest.mark.slow
def test_a_gguf_file_supplies_the_unet(tiny_model, tmp_path):
    """`--quantize unet=gguf:PATH`: the UNet's weights come from the file (Q8_0 Linear weights,
    dequantized per matmul), the plan counts the file's bytes, the images stay close, the
    fingerprint holds the file's sha256, and what cannot work is refused in one line."""
    import hashlib

    stored = _write_gguf(tiny_model, tmp_path / "unet-q8.gguf")
    file = (tmp_path / "unet-q8.gguf").resolve()
    pinned = f"unet=gguf:{file}#sha256={hashlib.sha256(file.read_bytes()).hexdigest()}"
    assert parse_quantize(f"unet=gguf:{file}").pinned().label == pinned
    path = write_prompts(tmp_path / "p.parquet", ["a red fox", "a blue owl"], id=["a", "b"])
    plain, plain_rows = _run(tiny_model, tmp_path / "plain", path)
    worker, rows = _run(tiny_model, tmp_path / "q", path, pinned)
    info = json.loads((tmp_path / "q" / "workers" / "w0.json").read_text())
    assert info["quantized"] == {"unet": pinned.split("=", 1)[1]}
    assert info["weight_bytes"]["unet"] == sum(stored.values()) == worker.profile.components["unet"].bytes
    assert info["weight_bytes"]["unet"] < 0.75 * plain.fitted.weight_bytes["unet"]
    for k in ("a", "b"):
        assert rows[k]["status"] == "ok" and rows[k]["quantized"] == pinned
        mse = ((pixels(tmp_path / "plain", plain_rows[k]) - pixels(tmp_path / "q", rows[k])) ** 2).mean()
        assert 10 * np.log10(255**2 / mse) >= MIN_PSNR
    with pytest.raises(ConfigError, match=r"no file at .*missing.gguf"):
        parse_quantize(f"unet=gguf:{tmp_path}/missing.gguf").pinned()
    with pytest.raises(ConfigError, match=r"the file's sha256 is [0-9a-f]{64}, not 00"):
        parse_quantize(f"unet=gguf:{file}#sha256=00").pinned()
    with pytest.raises(ConfigError, match=r"gguf takes its file"):
        parse_quantize("unet=gguf")
    with pytest.raises(ConfigError, match=r"`--offload block`: GGUF parameters under diffusers' group offloading"):
        validate(JobConfig.of(input="x", output="y", model="org/m", quantize=f"unet=gguf:{file}", offload="block"))
    vae = JobConfig.of(input=str(path), output="o", model=tiny_model, quantize=f"vae=gguf:{file}")
    with pytest.raises(ConfigError, match=r"gguf serves unet, .* only; a GGUF file holds a denoiser"):
        resolve_defaults(vae, Columns())
