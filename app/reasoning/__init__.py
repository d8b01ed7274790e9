"""Reasoning parsers (--reasoning-parser): a `<think>` model's completion read into
`reasoning_content` and `content`, streamed and whole (parsers: the rules; output: one
choice's reader). gpt-oss models get theirs from app.harmony."""
