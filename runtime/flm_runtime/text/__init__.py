"""Text output: the incremental detokenizer, the stop checker and the generic tool-call format."""
