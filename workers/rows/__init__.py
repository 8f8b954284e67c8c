"""A row's way to the device: shards, rows → work items → batches, input images, seeds."""
