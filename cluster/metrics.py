"""Worker metrics through Ray's own metrics API (`ray.util.metrics`), which Ray exports to
Prometheus on each node's metrics port (names get Ray's `ray_` prefix there). Tagged per worker
and device. Imported in the actor's process only (the worker's modules load torch); the driver's own
metric is the pool's (`fleetgen_shard_failures`, cluster/run.py)."""

from __future__ import annotations

from collections.abc import Iterator

from ray.util.metrics import Counter, Gauge

from fleetgen.workers.rows.shard import Shard
from fleetgen.workers.spec import BatchDone, ShardResult, WorkerSpec
from fleetgen.workers.worker import Worker

TAGS = ("worker", "device")


class MeteredWorker(Worker):
    """`workers.Worker` reporting as it goes: counters per batch, gauges per committed shard."""

    def __init__(self, spec: WorkerSpec):
        super().__init__(spec)
        self._tags = {"worker": spec.name, "device": self.info["device"]["name"]}
        self._images = Counter("fleetgen_images", "Images generated and stored", tag_keys=TAGS)
        self._errors = Counter("fleetgen_row_errors", "Rows recorded as errors", tag_keys=TAGS)
        self._shards = Counter("fleetgen_shards_committed", "Shards committed", tag_keys=TAGS)
        self._rate = Gauge("fleetgen_images_per_second", "Images per second of generation time", tag_keys=TAGS)
        self._onloaded = Gauge(
            "fleetgen_onloaded_bytes",
            "Bytes moved host to device by group offloading, since the worker started",
            tag_keys=TAGS,
        )
        self._peak = Gauge("fleetgen_peak_device_bytes", "Peak device memory allocated", tag_keys=TAGS)

    def iter_shard(self, shard: Shard) -> Iterator[BatchDone | ShardResult]:
        for event in super().iter_shard(shard):
            if isinstance(event, BatchDone):
                if event.images:
                    self._images.inc(event.images, tags=self._tags)
                if event.errors:
                    self._errors.inc(event.errors, tags=self._tags)
            elif isinstance(event, ShardResult) and not event.committed_by_other:
                self._shards.inc(1, tags=self._tags)
                info = self.describe()
                self._rate.set(info["stats"]["images_per_second"] or 0.0, tags=self._tags)
                offload = info["offload"]
                self._onloaded.set(sum(c["bytes_onloaded"] for c in offload["components"].values()), tags=self._tags)
                if offload.get("peak_device_bytes") is not None:
                    self._peak.set(offload["peak_device_bytes"], tags=self._tags)
            yield event
