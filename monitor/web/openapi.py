"""The OpenAPI document: the ingest and directive routes read their bodies raw (validated once, strictly,
from bytes), so the models those bodies follow are added to the document's components here. Every
constraint in them (integer bounds, the schema-version pattern) comes from the wire models themselves."""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import BaseModel

__all__ = ["document_models"]


def document_models(app: FastAPI, models: tuple[type[BaseModel], ...]) -> None:
    """Add ``models`` (and the models they use) to the app's OpenAPI components."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = build()
            comps = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                comps.update(schema.pop("$defs", {}))
                comps[model.__name__] = schema
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
