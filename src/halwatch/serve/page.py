"""The web page of ``halwatch serve`` at ``/``: paste or upload context, question and answer (or a JSONL file), pick
a detector, and see the probability, the verdict and the unsupported words highlighted in the answer (each span's
confidence on hover). Plain HTML and one small script, served from the package; no build step."""

from __future__ import annotations

from importlib import resources

from fastapi.responses import HTMLResponse, Response

TYPES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
         "style.css": "text/css; charset=utf-8"}


def _read(name: str) -> str:
    return (resources.files("halwatch") / "serve" / "static" / name).read_text(encoding="utf-8")


def add_page(app) -> None:
    @app.get("/", include_in_schema=False)
    async def page():
        return HTMLResponse(_read("index.html"))

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str):
        if name not in TYPES:
            return Response(status_code=404)
        return Response(_read(name), media_type=TYPES[name], headers={"Cache-Control": "no-cache"})
