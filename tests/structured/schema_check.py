"""A small JSON schema validator for the structured-output tests (the keywords their schemas use;
any other keyword is an error, so a schema it cannot check never passes unchecked)."""
KEYWORDS = {"type", "properties", "required", "additionalProperties", "items", "enum", "minimum", "maximum",
            "minLength", "maxLength", "minItems", "maxItems"}
TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def is_type(value, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, TYPES[name])


def schema_errors(value, schema: dict, path: str = "$") -> list[str]:
    """Every way `value` breaks `schema`, as 'path: what' lines; [] when it validates."""
    unknown = set(schema) - KEYWORDS
    if unknown:
        raise ValueError(f"{path}: schema_errors does not check {sorted(unknown)}")
    if "enum" in schema and value not in schema["enum"]:
        return [f"{path}: {value!r} not in {schema['enum']}"]
    if "type" in schema and not is_type(value, schema["type"]):
        return [f"{path}: {value!r} is not of type {schema['type']}"]
    errors = []
    for key, bad in (("minimum", lambda v, m: v < m), ("maximum", lambda v, m: v > m),
                     ("minLength", lambda v, m: len(v) < m), ("maxLength", lambda v, m: len(v) > m),
                     ("minItems", lambda v, m: len(v) < m), ("maxItems", lambda v, m: len(v) > m)):
        if key in schema and bad(value, schema[key]):
            errors.append(f"{path}: {value!r} breaks {key}={schema[key]}")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        errors += [f"{path}: missing {name!r}" for name in schema.get("required", []) if name not in value]
        if schema.get("additionalProperties", True) is False:
            errors += [f"{path}: unexpected {name!r}" for name in value if name not in properties]
        for name, item in value.items():
            if name in properties:
                errors += schema_errors(item, properties[name], f"{path}.{name}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += schema_errors(item, schema["items"], f"{path}[{i}]")
    return errors
