"""What a worker writes: storage and its error policy, layout, the field table, formats, writer, commit, video."""
