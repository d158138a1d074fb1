"""The OpenAPI schema's rules that hold for every operation (drf-spectacular
postprocessing hooks, ``SPECTACULAR_SETTINGS``)."""

from __future__ import annotations

from typing import Any


def query_values_not_empty(result: dict[str, Any], **_: Any) -> dict[str, Any]:
    """Every query parameter refuses an empty value (``?until=`` is a mistake,
    not "no limit": ``views.common.no_empty``): a string one is stated with
    ``minLength: 1``."""
    for item in result.get("paths", {}).values():
        for operation in item.values():
            if not isinstance(operation, dict):
                continue
            for parameter in operation.get("parameters", []):
                schema = parameter.get("schema", {})
                if parameter.get("in") == "query" and schema.get("type") == "string":
                    schema["minLength"] = max(1, schema.get("minLength", 0))
    return result
