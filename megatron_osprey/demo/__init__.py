"""`make demo`: the pipeline at toy scale on a laptop CPU."""
