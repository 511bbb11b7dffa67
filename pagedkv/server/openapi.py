"""The OpenAPI document at /openapi.json, with the request bodies the routes read themselves.

The generation routes parse their body by hand (any Content-Type, since
`curl -d` sends form-encoded JSON), so FastAPI cannot see their models.
`json_body(Model)` declares one on a route (`openapi_extra`) and
`install_openapi` adds the models' schemas to the document's components.
That is what a schema-driven fuzzer (tests/test_fuzz.py) works from.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

REF = "#/components/schemas/{model}"


def json_body(model: type[BaseModel]) -> dict:
    """`openapi_extra` for a route whose JSON body is `model`."""
    schema = {"$ref": REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install_openapi(app: FastAPI, bodies: list[type[BaseModel]]) -> None:
    """Build the document once, on first request, with `bodies` among its component schemas."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(  # servers: FastAPI puts a proxy's --root-path there
                title=app.title, version=app.version, routes=app.routes, servers=app.servers
            )
            _, defs = models_json_schema([(m, "validation") for m in bodies], ref_template=REF)
            doc.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to override it
