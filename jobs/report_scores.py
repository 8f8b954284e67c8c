"""The scores of `fleetgen report OUT` (jobs/report.py): per scorer a histogram and the mean with its
spread, over the stored images and the ones `--keep`/`--best-of` let go; grouped by a column (`--group-by
style`: the model, a LoRA, any carried column) so that one prompt suite rendered with several settings
shows which scored best. Read from the manifests' score columns alone, at most `SCORE_SHARDS` of them,
evenly spaced over the job (the page says how many)."""

from __future__ import annotations

import html
import math
import statistics

from fleetgen.errors import ConfigError
from fleetgen.jobs.state import read_manifests
from fleetgen.workers.output.layout import manifest_key
from fleetgen.workers.output.storage import Output, parquet_schema

SCORE_SHARDS = 256
BINS = 20


def scorer_names(generation: dict) -> list[str]:
    """The job's scorers, from its fingerprint's `scores` label (`clip=MODEL,...`; `none`)."""
    label = generation.get("scores") or "none"
    return [] if label == "none" else [part.split("=", 1)[0] for part in label.split(",") if "=" in part]


def check_columns(out: Output, counts: dict, generation: dict, group_by: str | None, sort_by: str | None) -> None:
    """`--sort-by` names a score of the job, `--group-by` a column of its manifests: else one line, exit 2."""
    names = scorer_names(generation)
    if sort_by and sort_by.removeprefix("-") not in names:
        raise ConfigError(
            f"`--sort-by {sort_by}`: the job scores {', '.join(names) or 'nothing (run it with --score)'}."
        )
    if group_by:
        shard = next((s for s in sorted(counts) if counts[s]["images"]), None)
        have = parquet_schema(out.get(manifest_key(shard))).names if shard else []
        if group_by not in have:
            raise ConfigError(f"`--group-by {group_by}` is not a column of the job's manifests ({', '.join(have)}).")


def scores_section(out: Output, counts: dict, generation: dict, group_by: str | None = None) -> str:
    names = scorer_names(generation)
    if not names:
        return ""
    shards = [s for s in sorted(counts) if counts[s]["images"]]
    k = min(SCORE_SHARDS, len(shards))
    picked = sorted({shards[round(i * (len(shards) - 1) / max(1, k - 1))] for i in range(k)})
    columns = ["status", *(f"score_{n}" for n in names), *([group_by] if group_by else [])]
    manifests = read_manifests(out, picked, columns)
    rows = [r for s in picked for r in manifests[s] if r["status"] in ("ok", "filtered")]
    stored = sum(r["status"] == "ok" for r in rows)
    parts = [
        f"<p>{len(rows)} scored images ({stored} stored, {len(rows) - stored} filtered) from {len(picked)} of "
        f"{len(shards)} shards.</p>"
    ]
    for n in names:
        values = [r[f"score_{n}"] for r in rows if _finite(r.get(f"score_{n}"))]
        kept = [r[f"score_{n}"] for r in rows if r["status"] == "ok" and _finite(r.get(f"score_{n}"))]
        parts.append(_histogram(n, values, kept))
    if group_by:
        parts.append(_groups(rows, names, group_by))
    return "<h2>Scores</h2>" + "".join(parts)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    sd = statistics.pstdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.4g} ± {sd:.2g}"


def _histogram(name: str, values: list[float], kept: list[float]) -> str:
    """`BINS` bars from the lowest to the highest score: every scored image (grey), the stored ones (blue)."""
    title = f"score_{name}: mean {_spread(values)} over {len(values)} images; stored: {_spread(kept)}"
    if not values:
        return f"<figure><figcaption>{html.escape(title)}</figcaption></figure>"
    low, high = min(values), max(values)
    width = (high - low) / BINS or 1.0

    def counts(vs: list[float]) -> list[int]:
        out = [0] * BINS
        for v in vs:
            out[min(int((v - low) / width), BINS - 1)] += 1
        return out

    every, stored = counts(values), counts(kept)
    top = max(every)
    bars = []
    for i, (a, b) in enumerate(zip(every, stored, strict=True)):
        x, ha, hb = 40 + i * 28, 120 * a / top, 120 * b / top
        bars.append(
            f'<rect x="{x}" y="{140 - ha:.1f}" width="24" height="{ha:.1f}" fill="#bbb"/>'
            f'<rect x="{x}" y="{140 - hb:.1f}" width="24" height="{hb:.1f}" fill="#4c78a8"/>'
        )
    axis = f'<text x="40" y="156">{low:.4g}</text><text x="{40 + BINS * 28 - 40}" y="156">{high:.4g}</text>'
    return (
        f"<figure><figcaption>{html.escape(title)}</figcaption>"
        f'<svg width="640" height="160" font-size="12" font-family="sans-serif">{"".join(bars)}{axis}</svg></figure>'
    )


def _groups(rows: list[dict], names: list[str], group_by: str) -> str:
    """Per value of `group_by`: its images and each score's mean ± spread, the best mean of each score in bold."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(str(r.get(group_by)), []).append(r)
    means = {
        n: {
            g: statistics.fmean(v)
            for g, rs in groups.items()
            if (v := [r[f"score_{n}"] for r in rs if _finite(r.get(f"score_{n}"))])
        }
        for n in names
    }
    best = {n: max(m, key=m.get) if m else None for n, m in means.items()}
    head = "".join(f"<th>score_{html.escape(n)}</th>" for n in names)
    body = []
    for g, rs in sorted(groups.items()):
        cells = []
        for n in names:
            text = html.escape(_spread([r[f"score_{n}"] for r in rs if _finite(r.get(f"score_{n}"))]))
            cells.append(f"<td><b>{text}</b></td>" if best[n] == g else f"<td>{text}</td>")
        body.append(f"<tr><td>{html.escape(g)}</td><td>{len(rs)}</td>{''.join(cells)}</tr>")
    return (
        f'<h3>By {html.escape(group_by)}</h3><table class="groups"><tr><th>{html.escape(group_by)}</th><th>images</th>'
        f"{head}</tr>{''.join(body)}</table>"
    )
