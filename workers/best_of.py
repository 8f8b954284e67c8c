"""Best-of-N (`--best-of N --rank-by NAME`): each image is made as N candidates, each with its own id
(`<image id>~<j>`) and seed; once every candidate of an image is made (or failed), the one with the
best score among those `--keep` keeps is the image — stored under the image's id, its record's id
the image's — and the others are `filtered` rows, their scores recorded, never stored.

Candidates of one image are adjacent in a shard's work (workers/rows/batches.py), so only the
pictures of the image being made are held, at most N at a time per look.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from fleetgen.workers.output.made import Made
from fleetgen.workers.rows.batches import CANDIDATE


def image_of(candidate_id: str) -> str:
    return candidate_id.split(CANDIDATE, 1)[0]


def place(row: dict) -> tuple[str, str]:
    """A committed manifest row's candidate id and image (`keep_committed`'s `place`): the stored best
    is recorded under its image's id with its `candidate` index."""
    key = (
        row["id"]
        if row.get("candidate") is None or CANDIDATE in row["id"]
        else f"{row['id']}{CANDIDATE}{row['candidate']}"
    )
    return key, image_of(key)


class BestOf:
    def __init__(self, n: int, rank_by: str):
        self.n, self.rank_by = n, rank_by
        self.name, self.sign = rank_by.removeprefix("-"), -1 if rank_by.startswith("-") else 1
        self.held: dict[str, list[tuple[Made, object]]] = {}  # image id -> (candidate, its inputs)
        self.done: Counter[str] = Counter()  # image id -> candidates made or failed

    def settle(self, made: list[Made], inputs: dict, failed: Iterable[str], records: dict) -> list[tuple[Made, object]]:
        """`made` (scored, `--keep` applied) and the ids that `failed` added to their images; returns
        the candidates of every image now complete, each as (candidate, its inputs), its best renamed
        to the image (`records[id]["id"]` too) and the rest let go."""
        touched = []
        for m in made:
            image = image_of(m.id)
            self.held.setdefault(image, []).append((m, inputs.get(m.id)))
            self.done[image] += 1
            touched.append(image)
        for candidate in failed:
            self.done[image_of(candidate)] += 1
            touched.append(image_of(candidate))
        out = []
        for image in dict.fromkeys(touched):
            if self.done[image] >= self.n:
                group = self.held.pop(image, [])
                del self.done[image]
                self._choose(image, [m for m, _ in group], records)
                out += group
        return out

    def _choose(self, image: str, group: list[Made], records: dict) -> None:
        eligible = [m for m in group if m.picture is not None and not m.kept_out]
        ranked = [m for m in eligible if m.scores.get(self.name) is not None]
        best = max(ranked, key=lambda m: self.sign * m.scores[self.name], default=None) if ranked else None
        best = best or (eligible[0] if eligible else None)  # none scored: the first, kept (nothing lost)
        for m in eligible:
            if m is not best:
                mine, theirs = m.scores.get(self.name), best.scores.get(self.name)
                m.kept_out = (
                    f"not the best of {self.n} by {self.rank_by} ({self.name} {_num(mine)}; "
                    f"{best.id} has {_num(theirs)}); not stored"
                )
                m.picture = None
        if best is not None:
            records[best.id]["id"] = image
            best.record_id, best.id = best.id, image


def _num(value: float | None) -> str:
    return "unscored" if value is None else f"{value:.4g}"
