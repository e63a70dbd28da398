"""Serving: what the scheduler and the HTTP server expose about compacted contexts."""
