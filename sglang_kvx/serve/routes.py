"""HTTP routes added to SGLang's own FastAPI app."""

from __future__ import annotations

from typing import Any, Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse


def add_routes(app: FastAPI, get_global_state: Callable[[], Any]) -> None:
    async def kvx_stats():
        """Pool and compaction figures; one entry per data-parallel rank under ``ranks``."""
        states = await get_global_state().tokenizer_manager.get_internal_state()
        ranks = [state.get("kvx", {}) for state in states]
        body = dict(ranks[0]) if ranks else {}
        if len(ranks) > 1:
            body["ranks"] = ranks
        return JSONResponse(body)

    app.add_api_route("/kvx/stats", kvx_stats, methods=["GET"])
