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
                if parameter.get("in") != "query":
                    continue
                schema = parameter["schema"] = _not_blank(parameter.get("schema", {}))
                if schema.get("type") == "string":
                    schema["minLength"] = max(1, schema.get("minLength", 0))
    return result


def _not_blank(schema: dict[str, Any]) -> dict[str, Any]:
    """A string that may be blank is ``oneOf`` [its pattern, ``maxLength: 0``]:
    in a query, the first alone."""
    branches = [b for b in schema.get("oneOf", []) if b.get("maxLength") != 0]
    if len(branches) != 1 or len(schema["oneOf"]) != 2:
        return schema
    outer = {k: v for k, v in schema.items() if k != "oneOf"}
    return {**outer, **branches[0]}


def job_request_kinds(result: dict[str, Any], **_: Any) -> dict[str, Any]:
    """A job request is a batch job (``name`` and ``command`` required) or an
    interactive one (``interactive`` jupyter or shell, none of the fields gpulab
    sets for it: ``serializers.INTERACTIVE_SETS``); OpenAPI 3.0 says so with
    ``anyOf``."""
    from portal.api.serializers import INTERACTIVE_SETS

    schema = result.get("components", {}).get("schemas", {}).get("JobRequestRequest")
    if schema is None:
        return result
    schema["anyOf"] = [
        {
            "required": ["name", "command"],
            "properties": {"interactive": {"enum": [""]}},
        },
        {
            "required": ["interactive"],
            "properties": {"interactive": {"enum": ["jupyter", "shell"]}},
            "not": {"anyOf": [{"required": [name]} for name in INTERACTIVE_SETS]},
        },
    ]
    # Every field has a default now (either kind may leave out the other's), so
    # drf-spectacular no longer marks the body required: it is.
    ref = "#/components/schemas/JobRequestRequest"
    for operations in result.get("paths", {}).values():
        for operation in operations.values():
            body = operation.get("requestBody") if isinstance(operation, dict) else None
            if body and any(
                media.get("schema", {}).get("$ref") == ref
                for media in body.get("content", {}).values()
            ):
                body["required"] = True
    return result
