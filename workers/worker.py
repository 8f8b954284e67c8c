"""One device's work: a fitted pipeline (workers/pipeline/fitted.py) making the images of one shard after
another, stored by the writer thread (workers/output/writer.py), each attempt at a shard committed in parts
and then by its manifest (workers/attempt.py). No Ray here: `cluster/` wraps this plain class in an actor,
and a benchmark or a test can use it directly."""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace

import pyarrow as pa
import torch

from fleetgen.errors import ShardError, StorageError
from fleetgen.imports import paused_gc
from fleetgen.workers.attempt import Attempt, Boundary, Commits, CommitUnknown
from fleetgen.workers.best_of import BestOf, place
from fleetgen.workers.info import describe, worker_info
from fleetgen.workers.notice import taking_notice, told_to_stop
from fleetgen.workers.output.commit import committed_since, keep_committed, staging
from fleetgen.workers.output.formats import Kept, get_format, open_sink
from fleetgen.workers.output.layout import worker_key
from fleetgen.workers.output.made import Made
from fleetgen.workers.output.parts import chain_end
from fleetgen.workers.output.rows import as_rows
from fleetgen.workers.output.storage import Output
from fleetgen.workers.output.video import Clip
from fleetgen.workers.output.writer import Writer, encode_and_store
from fleetgen.workers.pipeline.calls import prompt_note
from fleetgen.workers.pipeline.fitted import FittedPipeline
from fleetgen.workers.pipeline.scoring import Scoring
from fleetgen.workers.records import Records
from fleetgen.workers.rows.batches import REPEATED, WorkItem, content_ids, group_items, shard_items
from fleetgen.workers.rows.inputs import Prefetcher
from fleetgen.workers.rows.shard import Columns, Shard, read_shard
from fleetgen.workers.spec import BatchDone, PartCommitted, ShardResult, WorkerSpec


@dataclass
class _Loaded:
    """One batch as asked, with its input images loaded: `batch` the images whose inputs loaded (all,
    for a task without inputs), `inputs` {id: its loaded inputs}, `unreadable` {id: why not}."""

    asked: list[WorkItem]
    batch: list[WorkItem]
    inputs: dict
    unreadable: dict[str, str]

    @classmethod
    def of(cls, asked: list[WorkItem], prefetch: Prefetcher, records: dict, have: dict) -> _Loaded:
        """`asked`'s inputs, read by `prefetch` unless `have` ({id: (inputs, why not)}: a chunk loaded
        before a step-down re-batched it) holds them already."""
        new = [im for im in asked if im.id not in have]
        _, inputs, unreadable = prefetch.batch(new, records)
        have.update({im.id: (inputs.get(im.id), unreadable.get(im.id)) for im in new})
        batch = [im for im in asked if have[im.id][1] is None]
        return cls(
            asked,
            batch,
            {im.id: have[im.id][0] for im in batch if have[im.id][0]},
            {im.id: have[im.id][1] for im in asked if have[im.id][1]},
        )


def _as_given(record: dict) -> dict:
    """A repeated id's error record with its id as the input has it (items carry `<id>^<row>`)."""
    given = record["row_id"].rsplit(REPEATED, 1)[0]
    return {**record, "id": given, "row_id": given}


WINDOW_CAP = 4  # a window of rows whose images never make whole batches ends at 4 times its size
CONTENT_ID = "__fleetgen_content_id"  # a stage's rows' id column where the input has none (never carried)


class Worker:
    def __init__(self, spec: WorkerSpec, pipe=None):
        """`pipe`: a pipeline already built (bench/gpu_check.py's random weights at real sizes)
        instead of loading `spec.source.model`; `close()` leaves it as it came (no offloading hooks)."""
        started = time.perf_counter()
        self.spec = spec
        if spec.threads:
            torch.set_num_threads(spec.threads)
        self.output = Output(spec.output) if spec.output else None  # None: a Ray Data stage's, storing nothing
        with paused_gc():  # a pipeline's first load imports most of diffusers and transformers
            self.fitted = FittedPipeline(spec.source, spec.settings, spec.fit, spec.name, pipe, self.output)
        scores = spec.settings.score
        self.scoring = Scoring(scores, self.fitted.device, self.fitted.dtype) if scores else None
        self.recipe = spec.settings.recipe(self.fitted.size_multiple)
        self._writer = Writer()
        self.stats = {"shards": 0, "images": 0, "errors": 0}
        self._commits = Commits(self.output, spec, self._writer, self.stats, self._open_sink)
        self.info = worker_info(spec, self.fitted, time.perf_counter() - started)
        device, store = self.info["device"]["name"], spec.settings.store_inputs
        self._records = Records(
            self.recipe.template,
            spec.name,
            device,
            spec.source.model,
            store,
            spec.settings.cache.label,
            self.fitted.attention.backend,
        )
        self.write_info()

    # What the fitted pipeline decided, as the worker reports it.
    pipe = property(lambda self: self.fitted.pipe)
    plan = property(lambda self: self.fitted.plan)
    profile = property(lambda self: self.fitted.profile)
    batch_size = property(lambda self: self.fitted.batch_size)
    step_downs = property(lambda self: self.fitted.step_downs)

    def describe(self) -> dict:
        scoring = {"scoring": self.scoring.snapshot()} if self.scoring is not None else {}
        return {**describe(self.info, self.fitted, self.stats), **scoring}

    def write_info(self) -> None:
        """`OUT/workers/<w>.json`. A status record: when the store does not take it, the work goes
        on (the next shard writes it again). A worker with no output keeps it (`describe()`)."""
        if self.output is None:
            return
        try:
            self.output.put(worker_key(self.spec.name), json.dumps(self.describe(), indent=2).encode())
        except StorageError as err:
            print(f"[fleetgen] {self.spec.name}: {worker_key(self.spec.name)} not written: {err}", flush=True)

    def run_shard(self, shard: Shard) -> ShardResult:
        """Generate a whole shard and commit it; returns its result."""
        *_, result = self.iter_shard(shard)
        return result

    def iter_shard(self, shard: Shard) -> Iterator[BatchDone | ShardResult]:
        """Generate `shard`, yielding a `BatchDone` per pipeline call, then the `ShardResult`.

        Images are written as they are made, under this attempt's own staging prefix; the
        manifest is written last and is the commit (workers/output/commit.py): the first attempt to
        commit wins, moves its objects to their final keys, and a losing attempt never touches
        them. An attempt stops at its next batch once another has committed. A shard with
        `retry_errors` is committed already: only its error images are made again, the rest of its
        manifest and its stored images are kept as they are, and a new manifest is committed.
        """
        at = self._prepare(shard)
        won = unknown = False  # unknown: the commit may have landed; its staging must stay
        version = None
        try:
            with taking_notice(at.parts):
                while True:  # again from the chain's end when another attempt's part came first
                    outcome = yield from self._run(at)
                    if outcome == "done":
                        outcome, version = self._commits.commit(at)
                    if outcome != "moved":
                        break
            if outcome != "won":  # another attempt committed the shard first, or this one was told to stop
                self._commits.give_up(at)
                yield at.result(self.spec.name, committed_by_other=outcome != "stopped", stopped=outcome == "stopped")
                return
            won = True
        except CommitUnknown:
            unknown = True
            raise
        finally:
            if not won and not unknown:  # lost, failed, or stopped (the generator closed): nothing of it stays
                self._commits.give_up(at)
            elif unknown:
                self._writer.cancel()
        self.stats["shards"] += 1
        self.write_info()
        ok, errors = at.decided  # since its last part (that part's own event counted those)
        yield at.result(self.spec.name, ok, errors, counts=at.counts, version=version)

    def _run(self, at: Attempt) -> Iterator[BatchDone | PartCommitted]:
        """Make what is left, a part committed at a window's end once `commit_interval` has passed
        and where a notice finds the attempt; returns "done" (every row made), "other" (another
        attempt committed the shard), "stopped" (told to stop, what it made committed) or "moved"
        (another attempt's part came first: the attempt goes on from the chain's end)."""
        for event in self._make(at):
            if event is None:
                return "other"
            if not isinstance(event, Boundary):
                yield event
                continue
            if event.row >= at.rows:
                continue  # the last rows are the manifest's own
            due = time.monotonic() - at.last_part >= self.spec.commit_interval
            if due or event.stop:
                outcome = self._commits.commit_part(at, event.row)
                if isinstance(outcome, PartCommitted):
                    yield outcome
                elif outcome is not None:
                    return outcome
            if event.stop:
                return "stopped"
        return "done"

    def make_rows(self, table: pa.Table, base: str, name: str) -> pa.Table:
        """Rows of a Ray Data stage (cluster/ray_data.py): `table`'s images made as a shard's are, from the
        same items, seeds and records, encoded and kept instead of stored (`base`: what relative input
        paths are relative to; `name`: the rows' name in errors). Returns a row per image record, in the
        shard's order (workers/output/rows.py). Nothing is written or committed."""
        shard = Shard(name, base, 0, 0, 0, 0, table.num_rows)
        columns = self.spec.columns
        if not columns["id"]:  # a seed column and no id: the id is the row's content (never its position)
            table = table.append_column(CONTENT_ID, pa.array(content_ids(table), pa.string()))
            columns = replace(columns, by_role={**columns.by_role, "id": CONTENT_ID})
        images, records = self._items(shard, table, columns, repeats="error")
        sink = Kept()
        todo = [im for im in images if records[im.id]["status"] == "ok"]
        at = Attempt(
            shard,
            name,
            table,
            images,
            records,
            todo,
            set(),
            None,
            sink,
            best_of=self._best_of(),
            watch=False,
            piece=name,
        )
        try:
            for _ in self._make(at):
                pass
            self._writer.drain()
        except BaseException:
            self._writer.cancel()
            raise
        final = [records[im.id] for im in images]
        final = [_as_given(r) if REPEATED in r["id"] else r for r in final]
        ok = sum(r["status"] == "ok" for r in final)
        self.stats["images"] += ok
        self.stats["errors"] += len(final) - ok
        data = [getattr(sink.made.get(im.id), "data", None) for im in images]
        media = "video" if self.spec.settings.task_spec().video else "image"
        plan = self.fitted.plan
        offloaded = ", ".join(f"{n} {m}" for n, m in plan.modes.items() if m != "resident") or "all resident"
        return as_rows(
            final,
            data,
            table,
            self.spec.columns.carry,
            [im.row for im in images],
            media,
            self.spec.source.model,
            f"{offloaded}, batch {self.batch_size}",
        )

    def _items(
        self, shard: Shard, table: pa.Table, columns: Columns | None = None, repeats: str = "refuse"
    ) -> tuple[list, dict[str, dict]]:
        """A shard's images (workers/rows/batches.py) and their records as far as known before they are made."""
        images = shard_items(shard, table, columns or self.spec.columns, self.recipe, repeats)
        records = {im.id: self._records.new(im) for im in images}
        for im in images:
            if im.error is None:
                records[im.id].update(
                    prompt_note(
                        self.pipe, self.fitted.family, im.prompt, im.negative_prompt, self.spec.fit.strict_prompts
                    )
                )
        return images, records

    def _best_of(self) -> BestOf | None:
        settings = self.spec.settings
        return BestOf(settings.best_of, settings.rank_by) if settings.best_of > 1 else None

    def _prepare(self, shard: Shard) -> Attempt:
        """Read the shard, build its images and their manifest records, open its sink."""
        table = read_shard(shard, self.spec.columns)
        images, records = self._items(shard, table)
        best_of = self._best_of()
        where = place if best_of is not None else None  # a stored best is its candidate's record
        base, kept = keep_committed(self.output, shard.id, records, where) if shard.retry_errors else (None, set())
        # after the parts committed already (an earlier attempt's, this run's or another's), whatever the interval now
        start = chain_end(self.output, shard.id) if base is None else 0
        todo = [im for im in images if records[im.id]["status"] == "ok" and im.id not in kept and im.row >= start]
        parts = self.spec.commit_interval > 0 and base is None
        parts = parts and get_format(self.spec.settings.output_format).commits_in_parts
        at = Attempt(
            shard,
            uuid.uuid4().hex[:12],
            table,
            images,
            records,
            todo,
            kept,
            base,
            None,
            best_of=best_of,
            parts=parts,
            start=start,
        )
        at.sink = self._open_sink(shard, table, base, at.piece)
        return at

    def _make(self, at: Attempt) -> Iterator[BatchDone | Boundary | None]:
        """Every image to make, a batch at a time: a `BatchDone` per pipeline call, None (and
        stop) once another attempt has committed the shard. Input images are read ahead, in the
        order they are made, while the device works. Under a phased plan the batches come a chunk
        at a time, each chunk's prompts encoded first (workers/pipeline/phases.py). An attempt that
        commits in parts makes its rows a window at a time (`_windows`) and yields a `Boundary` at
        each window's end, and where a notice to stop finds it."""
        counts = Counter(im.row for im in at.images)  # images per row, for progress in rows
        windows = self._windows(at)
        order = [im for window in windows for group in group_items(window) for im in group]
        with Prefetcher(order, self.spec.settings.resize) as prefetch:
            for w, window in enumerate(windows):
                for group in group_items(window):
                    for loaded, chunk_done in self._batches(at, group, prefetch):
                        if at.watch and committed_since(self.output, at.shard.id, at.base):
                            yield None
                            return
                        yield self._batch(at, loaded, sum(1 / counts[im.row] for im in loaded.asked))
                        if (chunk_done or (at.parts and told_to_stop())) and at.pending:
                            yield self._decoded(at)
                        if at.parts and told_to_stop():
                            left = (im.row for im in at.todo if im.id not in at.done)
                            yield Boundary(min(left, default=at.rows), stop=True)
                            return
                if at.parts:
                    yield Boundary(windows[w + 1][0].row if w + 1 < len(windows) else at.rows)
        if at.todo and at.failures == len(at.todo) and at.base is None and not at.committed:
            raise ShardError(
                f"Shard {at.shard.id}: every row failed in the pipeline; first error: "
                f"{at.records[at.todo[0].id]['error']}"
            )

    def _windows(self, at: Attempt) -> list[list[WorkItem]]:
        """What is left in windows of whole rows, in row order: a part may end at any window's end.
        Each is at least a batch (a chunk, under a phased plan) per look among them and, where rows
        allow, whole batches, so that a shard of one look is batched as it would be whole and rows of
        mixed looks still fill their batches. Whole shards: one window."""
        if not at.parts or not at.todo:
            return [at.todo] if at.todo else []
        batch = self.batch_size
        size = max(batch, self.fitted.chunk_images) * len({im.look for im in at.todo})
        windows: list[list[WorkItem]] = [[]]
        for im in at.todo:
            current, n = windows[-1], len(windows[-1])
            whole = n % batch == 0 or n >= WINDOW_CAP * size
            if n >= size and whole and im.row != current[-1].row:
                windows.append([])
            windows[-1].append(im)
        return windows

    def _batches(self, at: Attempt, group: list[WorkItem], prefetch: Prefetcher) -> Iterator[tuple[_Loaded, bool]]:
        """`group`'s batches (one look) at the current batch size, their input images loaded, each with
        whether it ends its chunk; a chunk's inputs loaded and its prompts encoded before its first batch
        (a chunk is one batch unless phased); after an OOM step-down the rest of the chunk is re-batched,
        and encoded again, at the smaller size."""
        pending, have = group, {}
        while pending:
            size = self.batch_size
            chunk = max(self.fitted.chunk_images // size, 1) * size  # whole batches
            batches = [pending[j : j + size] for j in range(0, min(len(pending), chunk), size)]
            pending = pending[sum(map(len, batches)) :]
            loaded = [_Loaded.of(b, prefetch, at.records, have) for b in batches]
            if self.scoring is not None and self.fitted.deferred:  # scorers only after a decode phase (a
                self.scoring.release()  # plan stepped down to phased finds them still on the device)
            self.fitted.encode([(b.batch, b.inputs) for b in loaded if b.batch])
            for k, batch in enumerate(loaded):
                yield batch, k == len(loaded) - 1
                for im in batch.asked:
                    have.pop(im.id, None)
                if self.batch_size < size:  # stepped down
                    pending = [im for b in batches[k + 1 :] for im in b] + pending
                    break

    def _batch(self, at: Attempt, loaded: _Loaded, rows: float) -> BatchDone:
        """One pipeline call: the batch's inputs (an unreadable one fails its row only), the call,
        its pictures handed to the writer thread, which encodes, hashes and stores them while the
        device makes the next batch."""
        batch, inputs, unreadable = loaded.batch, loaded.inputs, loaded.unreadable
        made, failed, filtered, frames = [], {}, 0, 0
        at.made += len(loaded.asked)
        at.done.update(im.id for im in loaded.asked)
        if batch:
            made, failed = self.fitted.generate(batch, inputs)
        if self.fitted.deferred:  # decoded at the chunk's end (`_decoded`)
            at.pending.append((made, inputs))
            filtered, frames = self._store(at, [], {}, [*failed, *unreadable])
        else:
            filtered, frames = self._store(at, made, inputs, [*failed, *unreadable])
        self._failed(at, failed)
        errors = len(failed) + filtered + len(unreadable)
        return BatchDone(
            at.shard.id, self.spec.name, len(made) - filtered, errors, rows=rows, frames=frames, made=len(loaded.asked)
        )

    def _decoded(self, at: Attempt) -> BatchDone:
        """A phased plan's decode phase for the chunk's batches: their pictures stored, an image whose
        decode failed an error row. Progress: its images were counted as their batches were made."""
        failed = self.fitted.decode()
        if self.scoring is not None:  # the scorers' phase: the device theirs, the VAE's weights off it
            self.fitted.leave_phases()
        filtered = frames = 0
        for made, inputs in at.pending:
            ok = [m for m in made if m.id not in failed]
            f, n = self._store(at, ok, inputs, [m.id for m in made if m.id in failed])
            filtered, frames = filtered + f, frames + n
        at.pending = []
        if self.scoring is not None:  # and off it again: the next chunk's encoders need it
            self.scoring.release()
        self._failed(at, failed)
        return BatchDone(at.shard.id, self.spec.name, 0, len(failed) + filtered, frames=frames)

    def _store(self, at: Attempt, made: list[Made], inputs: dict, failed=()) -> tuple[int, int]:
        """Pictures scored, records filled, pictures handed to the writer thread; (filtered, frames)
        counted first (the writer drops each picture once encoded). `--best-of`: the candidates of the
        images `made` and `failed` (ids that failed) complete, the best of each the image."""
        if self.scoring is not None:
            self._score(at, [m for m in made if m.picture is not None])
        pairs = [(m, inputs.get(m.id)) for m in made]
        if at.best_of is not None:
            pairs = at.best_of.settle(made, inputs, failed, at.records)
        made = [m for m, _ in pairs]
        for m, given in pairs:
            self._records.fill(m, at.records[m.record_id or m.id], given)
        filtered = sum(m.picture is None for m in made)  # flagged by a safety checker: not stored
        frames = sum(len(m.picture.frames) for m in made if isinstance(m.picture, Clip))
        if made:
            self._writer.submit(self._encode_and_store, at.sink, made, at.records, at.table)
        return filtered, frames

    def _score(self, at: Attempt, made: list[Made]) -> None:
        """Each decoded picture scored (`--score`) and, where `--keep` rejects its scores, let go: a
        filtered row. A picture a scorer failed on keeps its other scores and is stored."""
        if not made:  # (a batch whose pictures come from the decode phase: nothing to score yet)
            return
        keep = self.spec.settings.keep
        prompts = [at.records[m.id]["prompt"] or "" for m in made]
        for m, (scores, error) in zip(made, self.scoring.score([m.picture for m in made], prompts), strict=True):
            m.scores, m.score_error = scores, error
            if keep.keeps(scores) is False:
                m.kept_out, m.picture = keep.why(scores), None

    @staticmethod
    def _failed(at: Attempt, failed: dict[str, str]) -> None:
        for image_id, error in failed.items():
            at.records[image_id].update(status="error", error=error)
        at.failures += len(failed)

    def _open_sink(self, shard: Shard, table: pa.Table, base: bytes | None, attempt: str):
        s, carry = self.spec.settings, self.spec.columns.carry
        carried = table.select(list(carry)).schema.remove_metadata() if carry else None
        sink = open_sink(
            self.output,
            shard.id,
            s.output_format,
            s.media_format(),
            carried,
            staging(shard.id, attempt),
            s.companions(),
        )
        if base is not None:
            sink.keep_existing()  # a retry: the shard's stored images stay, byte for byte
        return sink

    def _encode_and_store(self, sink, made: list[Made], records: dict, table: pa.Table) -> None:
        """On the writer thread: encode, hash and store a batch (workers/output/writer.py)."""
        carry = self.spec.columns.carry
        carried = table.select(list(carry)).take([m.row for m in made]) if carry else None
        settings = self.spec.settings
        encode_and_store(sink, made, records, carried, settings.media_format(), settings.crf, settings.store_frames)

    def close(self) -> None:
        self._writer.close()
        self.fitted.close()
