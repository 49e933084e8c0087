"""The app's /openapi.json with the request bodies' schemas: the handlers read their bodies themselves (size cap,
JSON depth, parsing off the event loop), so FastAPI does not see the pydantic models; this puts each route's
model under its requestBody and the models it refers to under components.schemas."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

REF = "#/components/schemas/{model}"


def add_request_schemas(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """bodies: POST path -> its body model."""

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = spec.setdefault("components", {}).setdefault("schemas", {})
        for path, model in bodies.items():
            op = spec.get("paths", {}).get(path, {}).get("post")
            if op is None:
                raise ValueError(f"no POST route {path} to describe")
            schema = model.model_json_schema(ref_template=REF)
            components.update(schema.pop("$defs", {}))
            components[model.__name__] = schema
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": REF.format(model=model.__name__)}}}}
        app.openapi_schema = spec
        return spec

    app.openapi = openapi


def fuzz(url: str, cases: int) -> dict:
    """schemathesis (the dev extra) over a running server's /openapi.json: `cases` generated requests across
    every operation. Returns {"cases": run, "server_errors": [(method, path, status, body head), ...]}."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    seen = {"cases": 0, "server_errors": []}

    @settings(max_examples=cases, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(case=schema.as_strategy())
    def run(case):
        seen["cases"] += 1
        r = case.call(base_url=url, timeout=60)
        if r.status_code >= 500:
            seen["server_errors"].append((case.method, case.formatted_path, r.status_code, r.text[:200]))

    run()
    return seen
