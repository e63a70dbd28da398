"""Compaction inside SGLang: parents compacted after prefill, children served from the store."""
