"""HTTP routes added to SGLang's own FastAPI app."""

from __future__ import annotations

from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

MAX_VALIDATION_ERRORS_SHOWN = 3


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


def scrub_validation_errors(app: FastAPI) -> None:
    """A malformed request body gets a 400 naming what is wrong (where, what, why), with neither the
    server's file paths nor the client's input echoed back. Routes whose documented error shapes
    differ (Anthropic's /v1/messages, /v1/systemone) keep the server's own handler."""
    previous = app.exception_handlers.get(RequestValidationError)

    async def handler(request: Request, exc: RequestValidationError):
        path = request.url.path.removeprefix(request.scope.get("root_path", ""))
        if previous is not None and (path.startswith("/v1/messages") or path == "/v1/systemone"):
            return await previous(request, exc)
        problems = []
        for error in exc.errors()[:MAX_VALIDATION_ERRORS_SHOWN]:
            where = ".".join(str(part) for part in error.get("loc", ()) if part != "body") or "body"
            problems.append(f"{where}: {str(error.get('msg', 'invalid'))[:200]}")
        message = "invalid request: " + "; ".join(problems)
        return JSONResponse(status_code=400, content={"object": "error", "message": message, "type": "Bad Request",
                                                      "param": None, "code": 400})

    app.add_exception_handler(RequestValidationError, handler)
