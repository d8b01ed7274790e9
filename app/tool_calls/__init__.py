"""Tool calling: request checks, the JSON schemas that enforce required and named choices,
and the parsers that read calls out of model text (streamed and whole)."""
