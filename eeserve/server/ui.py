"""The playground page: ``GET /`` and its static files under ``/ui/``, shipped in the package.

Contract: ``add_ui_routes(app)`` serves ``eeserve/server/static/index.html`` at ``/`` and the
page's CSS and JavaScript at ``/ui/<file>``. The page is plain files (no build step, no CDN) that
call this server's own OpenAI routes from the browser; ``UI_PATHS`` lists what an API key does not
guard (the page holds no secret: the key is typed into it and sent by it).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parent / "static"
UI_PREFIX = "/ui/"
UI_PATHS = ("/",)


def add_ui_routes(app: FastAPI) -> None:
    @app.get("/", include_in_schema=False)
    async def playground() -> Response:
        # no-cache: a page from an older server version must not talk to a newer API
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount(UI_PREFIX.rstrip("/"), StaticFiles(directory=STATIC), name="ui")
