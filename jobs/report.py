"""`fleetgen report OUT`: one static page, `OUT/report.html` — a contact sheet of sample images with
their prompts and seeds, the per-worker table and charts, and the failures. No JavaScript
libraries, no network: images are linked relative to the page (files output) or embedded."""

from __future__ import annotations

import base64
import html
import string
from pathlib import Path

from fleetgen.jobs.report_scores import check_columns, scorer_names, scores_section
from fleetgen.jobs.state import read_manifests
from fleetgen.jobs.status import host_copy_text, job_state, plan_kinds
from fleetgen.units import format_size
from fleetgen.workers.output.formats import get_format
from fleetgen.workers.output.layout import IMAGE_FORMATS, POSTER, beside
from fleetgen.workers.output.storage import Output
from fleetgen.workers.spec import makes_clips

SAMPLE = 24  # images on the contact sheet
ERRORS = 50  # rows that are not ok, listed
_MIME = {"png": "image/png", "jpg": "image/jpeg", "webp": "image/webp"}
_COLUMNS = (
    "id",
    "prompt",
    "seed",
    "status",
    "error",
    "warning",
    "image",
    "member",
    "worker",
    "inputs",
    "num_frames",
    "fps",
)
THUMB = 128  # pixels a side of an input's thumbnail beside its output


def _sources(out: Output, fmt, rows: list[dict], ext: str, video: bool = False) -> dict[str, str]:
    """How the page reaches each image: a relative link where each image is an object of its own,
    else its bytes embedded, read from its shard's object (once per shard) by the output format.
    A clip is shown by its first frame: the poster stored beside it, or decoded from its bytes."""
    if fmt.linked:
        return {r["id"]: html.escape(beside(r["image"], POSTER) if video else r["image"]) for r in rows}
    by_shard: dict[str, list[dict]] = {}
    for r in rows:
        by_shard.setdefault(r["shard"], []).append(r)
    sources = {}
    for shard, shard_rows in by_shard.items():
        stored, _ = fmt.read_back(out, shard, shard_rows, {r["id"] for r in shard_rows})
        for image_id, (_size, data) in stored.items():
            if data is not None and video:
                sources[image_id] = _first_frame_url(data)
            elif data is not None:
                sources[image_id] = f"data:{_MIME[ext]};base64,{base64.b64encode(data).decode()}"
    return sources


def _first_frame_url(data: bytes) -> str:
    """A clip's first frame as an embedded JPEG ("" for a clip that does not decode)."""
    import io

    from fleetgen.workers.output.video import first_frame

    try:
        frame = first_frame(data)
    except Exception:  # noqa: BLE001 - a report never fails over one clip it cannot show
        return ""
    buf = io.BytesIO()
    frame.save(buf, "JPEG", quality=85)
    return f"data:image/jpeg;base64,{base64.b64encode(buf.getvalue()).decode()}"


def _input_thumbs(rows: list[dict]) -> dict[str, str]:
    """{image id: its first input as an embedded PNG thumbnail}, for the sample's image-input rows:
    read from its path or URL (through fsspec, as the worker read it) and checked against the
    sha256 its record holds; an input that is gone or changed, or was bytes in the input's column,
    is named instead (an empty entry)."""
    import hashlib
    import io

    from PIL import Image

    from fleetgen.workers.rows.inputs import InputRef, read_bytes

    thumbs = {}
    for r in rows:
        first = next((x for x in r.get("inputs") or [] if x["role"] == "image"), None)
        if first is None or not first.get("version"):
            continue
        try:
            data, _ = read_bytes(InputRef("image", first["source"]))
        except Exception:  # noqa: BLE001 - a report never fails over one input it cannot show
            continue
        if hashlib.sha256(data).hexdigest() != first["sha256"]:
            continue
        picture = Image.open(io.BytesIO(data)).convert("RGB")
        picture.thumbnail((THUMB, THUMB))
        buf = io.BytesIO()
        picture.save(buf, "PNG")
        thumbs[r["id"]] = f"data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}"
    return thumbs


def _clip_note(r: dict) -> str:
    return f", {r['num_frames']} frames at {r['fps']:g} fps" if r.get("num_frames") else ""


def _input_note(r: dict, thumbs: dict[str, str]) -> str:
    """The card's input → output pair: the input's thumbnail, or what the record says of it."""
    first = next((x for x in r.get("inputs") or [] if x["role"] == "image"), None)
    if first is None:
        return ""
    if r["id"] in thumbs:
        return f'<img class="input" src="{thumbs[r["id"]]}" alt="input of {html.escape(r["id"])}"> &rarr; '
    what = "bytes in the input's column" if not first.get("version") else f"{first['source']} (gone or changed)"
    return f'<span class="input">input: {html.escape(what)}, sha256 {first["sha256"][:12]}</span><br>'


def _bars(title: str, items: list[tuple[str, float, str]], limit: list[float] | None = None) -> str:
    """A horizontal bar chart as inline SVG; `limit` draws a marker per bar (e.g. the budget)."""
    top = max([v for _, v, _ in items] + (limit or []) + [1e-9])
    rows = []
    for i, (label, value, text) in enumerate(items):
        y = 24 + i * 26
        w = 360 * value / top
        rows.append(
            f'<text x="0" y="{y + 14}">{html.escape(label)}</text>'
            f'<rect x="120" y="{y}" width="{w:.1f}" height="18" fill="#4c78a8"/>'
            f'<text x="{126 + w:.1f}" y="{y + 14}">{html.escape(text)}</text>'
        )
        if limit and limit[i]:
            x = 120 + 360 * limit[i] / top
            rows.append(
                f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y - 2}" y2="{y + 20}" stroke="#e45756" stroke-width="2"/>'
            )
    height = 30 + 26 * len(items)
    return (
        f'<figure><figcaption>{html.escape(title)}</figcaption><svg width="640" height="{height}" '
        f'font-size="12" font-family="sans-serif">{"".join(rows)}</svg></figure>'
    )


def sample_images(
    out: Output, counts: dict[str, dict], n: int = SAMPLE, columns: list[str] | None = None
) -> list[dict]:
    """About `n` ok images spread over the job: the manifests of at most `n` committed shards,
    evenly spaced, are read (never every manifest), and ok rows taken evenly from each (with `columns`
    besides the sheet's own)."""
    shards = [s for s in sorted(counts) if counts[s]["ok"]]
    k = min(n, len(shards))
    picked = [shards[round(i * (len(shards) - 1) / max(1, k - 1))] for i in range(k)]  # first to last
    manifests = read_manifests(out, picked, [*_COLUMNS, *(columns or [])])
    per = -(-n // len(picked)) if picked else 0
    rows = []
    for shard in picked:
        ok = [{**r, "shard": shard} for r in manifests[shard] if r["status"] == "ok"]
        rows += ok[:: max(1, len(ok) // per)][:per]
    return rows[:n]


def not_ok_rows(out: Output, counts: dict[str, dict], n: int = ERRORS, batch: int = 32) -> list[dict]:
    """The first `n` rows that are not ok, reading only manifests whose counts have such rows."""
    shards = [s for s in sorted(counts) if counts[s]["images"] > counts[s]["ok"]]
    rows: list[dict] = []
    for i in range(0, len(shards), batch):
        manifests = read_manifests(out, shards[i : i + batch], list(_COLUMNS))
        rows += [r for s in shards[i : i + batch] for r in manifests[s] if r["status"] != "ok"]
        if len(rows) >= n:
            break
    return rows[:n]


TEMPLATE = Path(__file__).with_name("templates") / "report.html"  # the page, with $fields filled in here


def write_report(url: str, group_by: str | None = None, sort_by: str | None = None) -> str:
    """Write OUT/report.html; returns its URL. Reads a sample of manifests, not all of them. A job with
    scores gets their histograms (grouped by the column `group_by`), and its contact sheet ordered by
    the score `sort_by` (highest first; `-NAME`: lowest first)."""
    state = job_state(url)
    out = Output(url)
    fp = state.job["fingerprint"]
    generation = fp["generation"]
    check_columns(out, state.counts, generation, group_by, sort_by)
    errors = not_ok_rows(out, state.counts)
    page = string.Template(TEMPLATE.read_text()).substitute(
        url=html.escape(state.url),
        model=html.escape(str(fp["model"])),
        width=generation["width"],
        height=generation["height"],
        steps=generation["steps"],
        guidance=generation["guidance"],
        state="complete" if state.complete else "not complete",
        shards_committed=state.shards_committed,
        shards_total=state.shards_total,
        images_ok=state.images_ok,
        images_error=state.images_error,
        failed_shards=len(state.failures),
        cards=_cards(out, state, generation, sort_by) or "<p>No images yet.</p>",
        scores=scores_section(out, state.counts, generation, group_by),
        workers="".join(_worker_row(w, state.images_redone.get(w["worker"], 0)) for w in state.workers),
        redone=sum(state.images_redone.values()),
        kinds="".join(
            "<tr>"
            + "".join(f"<td>{html.escape(str(k[c]))}</td>" for c in ("kind", "plan", "batch", "chosen", "speed"))
            + f"<td>{html.escape(', '.join(k['workers']))}</td></tr>"
            for k in plan_kinds(state.workers)
        )
        or '<tr><td colspan="6">no worker has reported yet</td></tr>',
        charts=_charts(state.workers),
        failures="".join(
            f"<tr><td>{html.escape(f['shard'])}</td><td>{f['attempts']}</td><td>{html.escape(f['error'])}</td></tr>"
            for f in state.failures
        )
        or '<tr><td colspan="3">none</td></tr>',
        errors_shown=ERRORS,
        errors="".join(
            f"<tr><td>{html.escape(r['id'])}</td><td>{html.escape(r['error'] or '')}</td></tr>" for r in errors
        )
        or '<tr><td colspan="2">none</td></tr>',
    )
    out.put("report.html", page.encode())
    return out.key_url("report.html")


def _cards(out: Output, state, generation: dict, sort_by: str | None = None) -> str:
    """The contact sheet: a sample of images (a clip's poster), each with its inputs, id, seed, prompt and
    scores; ordered by `sort_by` where given."""
    names = scorer_names(generation)
    sample = sample_images(out, state.counts, columns=[f"score_{n}" for n in names])
    if sort_by:
        name, sign = sort_by.removeprefix("-"), 1 if sort_by.startswith("-") else -1
        sample.sort(key=lambda r: (r.get(f"score_{name}") is None, sign * (r.get(f"score_{name}") or 0.0)))
    video = makes_clips(generation)
    fmt = get_format(generation["output_format"])
    sources = _sources(out, fmt, sample, IMAGE_FORMATS.get(generation["image_format"], "png"), video)
    thumbs = _input_thumbs(sample)

    def picture(r: dict) -> str:
        img = f'<img src="{sources.get(r["id"], "")}" alt="{html.escape(r["id"])}">'
        if video and fmt.linked:  # the poster, linked to its clip
            return f'<a href="{html.escape(r["image"])}">{img}</a>'
        return img

    return "".join(
        f'<figure class="card">{_input_note(r, thumbs)}{picture(r)}<figcaption><b>{html.escape(r["id"])}</b> '
        f"seed {r['seed']}{_clip_note(r)}{_score_note(r, names)}<br>{html.escape(r['prompt'] or '')}</figcaption></figure>"
        for r in sample
    )


def _score_note(r: dict, names: list[str]) -> str:
    scored = [f"{n} {r[f'score_{n}']:.3g}" for n in names if r.get(f"score_{n}") is not None]
    return f'<br><span class="scores">{html.escape(", ".join(scored))}</span>' if scored else ""


def _moved(w: dict) -> int:
    return sum(c["bytes_onloaded"] for c in ((w.get("offload") or {}).get("components") or {}).values())


def _worker_row(w: dict, redone: int = 0) -> str:
    st, off = w.get("stats") or {}, w.get("offload") or {}
    cells = (
        w["worker"],
        w["device"]["name"],
        format_size(w["device"]["total_bytes"]) if w["device"].get("total_bytes") else "-",
        format_size(w["plan"]["budget_bytes"]) if w["plan"].get("budget_bytes") else "-",
        ", ".join(f"{k} {v}" for k, v in w["plan"]["modes"].items()),
        w.get("batch_size"),
        st.get("images", 0),
        redone,
        f"{st.get('images_per_second') or 0:.2f}",
        format_size(off["peak_device_bytes"]) if off.get("peak_device_bytes") else "-",
        format_size(_moved(w)),
        host_copy_text(w["host_copy"]) if w.get("host_copy") else "-",
        w["plan"]["reason"],
    )
    return "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in cells) + "</tr>"


def _charts(workers: list[dict]) -> str:
    """Images/s, peak device memory against the budget, and bytes moved, per worker."""
    if not workers:
        return ""
    rates = [(w.get("stats") or {}).get("images_per_second") or 0 for w in workers]
    peaks = [((w.get("offload") or {}).get("peak_device_bytes") or 0) for w in workers]
    budgets = [w["plan"].get("budget_bytes") or 0 for w in workers]
    moved = [_moved(w) for w in workers]
    names = [w["worker"] for w in workers]
    return (
        _bars("images/s per worker", [(n, r, f"{r:.2f}") for n, r in zip(names, rates, strict=True)])
        + _bars(
            "peak device memory (bar) against the budget (red line)",
            [(n, p, format_size(p) if p else "not measured (CPU)") for n, p in zip(names, peaks, strict=True)],
            limit=budgets,
        )
        + _bars("bytes moved host→device", [(n, m, format_size(m)) for n, m in zip(names, moved, strict=True)])
    )
