"""The family table: entries, tasks, detection of a model's family, model directories. No torch."""
