"""HTTP routes added to SGLang's own FastAPI app."""

from __future__ import annotations

from typing import Any, Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse


def add_routes(app: FastAPI, get_global_state: Callable[[], Any]) -> None:
    async def ranks() -> list[dict]:
        states = await get_global_state().tokenizer_manager.get_internal_state()
        return [state.get("kvx", {}) for state in states]

    async def kvx_stats():
        """Pool and compaction figures; one entry per data-parallel rank under ``ranks``."""
        per_rank = [{k: v for k, v in rank.items() if k != "keep_sets"} for rank in await ranks()]
        body = dict(per_rank[0]) if per_rank else {}
        if len(per_rank) > 1:
            body["ranks"] = per_rank
        return JSONResponse(body)

    async def kvx_keep_sets():
        """Every compacted context's kept positions per attention layer and KV head (for audits and oracles)."""
        return JSONResponse([entry for rank in await ranks() for entry in rank.get("keep_sets", [])])

    app.add_api_route("/kvx/stats", kvx_stats, methods=["GET"])
    app.add_api_route("/kvx/keep_sets", kvx_keep_sets, methods=["GET"])
