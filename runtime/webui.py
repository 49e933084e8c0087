"""The chat page: static files shipped in the package (runtime/static), served at `/` and `/static/`.
No build step and nothing from another host; the page calls the server's own /v1 routes."""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parent / "static"


def mount(app: FastAPI) -> None:
    """GET / answers the page; /static/ its script and style. Neither needs the API key: the page asks for it."""
    if not (STATIC_DIR / "index.html").is_file():
        raise FileNotFoundError(f"the chat page is missing from the package: {STATIC_DIR / 'index.html'}")

    @app.get("/", include_in_schema=False)
    async def index():
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
