"""The OpenAPI document at /openapi.json, with the request bodies the routes read themselves.

The generation routes parse their body by hand (any Content-Type, since
`curl -d` sends form-encoded JSON), so FastAPI cannot see their models.
`json_body(Model)` declares one on a route (`openapi_extra`) and remembers it;
`install_openapi` adds every model so declared to the document's components, so
that no route's body names a schema the document lacks. That is what a
schema-driven fuzzer (tests/test_fuzz.py) and client generators work from.
"""

from __future__ import annotations

from typing import Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

REF = "#/components/schemas/{model}"
_DECLARED: dict[str, type[BaseModel]] = {}  # every body json_body has declared, by name


def json_body(*models: type[BaseModel]) -> dict:
    """`openapi_extra` for a route whose JSON body is one of `models`."""
    _DECLARED.update((m.__name__, m) for m in models)
    refs = [{"$ref": REF.format(model=m.__name__)} for m in models]
    schema = refs[0] if len(refs) == 1 else {"oneOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install_openapi(app: FastAPI) -> None:
    """Build the document once, on first request, with every declared body among its component
    schemas."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(  # servers: FastAPI puts a proxy's --root-path there
                title=app.title, version=app.version, routes=app.routes, servers=app.servers
            )
            mode: Literal["validation"] = "validation"
            _, defs = models_json_schema([(m, mode) for m in _DECLARED.values()], ref_template=REF)
            doc.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to override it
