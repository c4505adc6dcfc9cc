//! JSON Schemas as llmq compiles them: closed the way OpenAI's strict structured outputs read
//! them, and laid out in one way.
//!
//! JSON Schema leaves an object open when it does not give `additionalProperties`: any other
//! property may follow the named ones. Held to such a schema, a small model fills the room with
//! properties nobody asked for until `max_tokens`. OpenAI's strict mode treats every object as
//! closed (it asks for `additionalProperties: false`); `close_objects` writes that into a schema
//! wherever an object schema leaves it out, so the compiled constraint allows only the named
//! properties, each once.
//!
//! Rules: a schema that gives `additionalProperties` (or `unevaluatedProperties`) keeps it; an
//! intersection (`allOf` with several members) is left open, members and holder, since closing
//! any part would make it refuse the properties the other parts name (a single-member `allOf`,
//! pydantic's wrapper of a reference, is followed like any subschema); every subschema keyword
//! of draft 2020-12 and of draft 7 is followed. Objects left open still never repeat a key: the
//! matcher's key guard (`json_keys`) sees to that.

use serde_json::{json, Map, Value};

/// llguidance's compile options, read from a schema's root.
const OPTIONS: &str = "x-guidance";

/// Gives a schema llmq's JSON layout unless it names its own options: one space after `:` and
/// `,`, no other whitespace. Left free, the whitespace between tokens is the model's to choose
/// at every step, and small models wander into newlines and indentation that cost tokens and
/// lead their values astray; this is the layout most JSON they were trained on has.
pub fn with_layout(schema: &mut Value) {
    if let Value::Object(s) = schema {
        s.entry(OPTIONS).or_insert_with(
            || json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
}

/// Keywords whose value is one subschema.
const ONE: &[&str] = &[
    "additionalProperties",
    "items",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "unevaluatedItems",
    "propertyNames",
    "additionalItems",
];
/// Keywords whose value is a list of subschemas.
const LIST: &[&str] = &["prefixItems", "anyOf", "oneOf", "items"];
/// Keywords whose value maps names to subschemas.
const MAP: &[&str] = &[
    "properties",
    "patternProperties",
    "$defs",
    "definitions",
    "dependentSchemas",
];

/// Whether `s` describes objects: its `type` says so, or it names properties.
fn is_object_schema(s: &Map<String, Value>) -> bool {
    let typed = match s.get("type") {
        Some(Value::String(t)) => t == "object",
        Some(Value::Array(ts)) => ts.iter().any(|t| t == "object"),
        _ => false,
    };
    typed
        || s.contains_key("properties")
        || s.contains_key("patternProperties")
        || s.contains_key("required")
}

/// Closes every object schema in `schema` that does not say whether other properties may
/// follow (see the module's rules).
pub fn close_objects(schema: &mut Value) {
    close(schema, true);
}

fn close(schema: &mut Value, closable: bool) {
    let Value::Object(s) = schema else { return };
    let intersection = matches!(s.get("allOf"), Some(Value::Array(parts)) if parts.len() > 1);
    if closable
        && !intersection
        && is_object_schema(s)
        && !s.contains_key("additionalProperties")
        && !s.contains_key("unevaluatedProperties")
    {
        s.insert("additionalProperties".into(), Value::Bool(false));
    }
    for key in ONE {
        if let Some(v @ Value::Object(_)) = s.get_mut(*key) {
            close(v, true);
        }
    }
    for key in LIST {
        if let Some(Value::Array(items)) = s.get_mut(*key) {
            items.iter_mut().for_each(|v| close(v, true));
        }
    }
    for key in MAP {
        if let Some(Value::Object(m)) = s.get_mut(*key) {
            m.values_mut().for_each(|v| close(v, true));
        }
    }
    if let Some(Value::Array(parts)) = s.get_mut("allOf") {
        parts.iter_mut().for_each(|v| close(v, !intersection));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A pydantic model's schema: nested objects under `$defs`, a list of objects, an optional
    /// object (`anyOf` with null) and a free-form map all end up as strict mode reads them.
    #[test]
    fn closes_objects_everywhere_and_keeps_what_a_schema_says() {
        let mut s = json!({
            "type": "object",
            "properties": {
                "owner": {"$ref": "#/$defs/Person"},
                "people": {"type": "array", "items": {"$ref": "#/$defs/Person"}, "maxItems": 3},
                "backup": {"anyOf": [{"$ref": "#/$defs/Person"}, {"type": "null"}]},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "extra": {"type": "object", "additionalProperties": true},
                "tuple": {"type": "array", "prefixItems": [{"properties": {"a": {}}}]},
            },
            "required": ["owner"],
            "$defs": {"Person": {"type": "object", "properties": {"name": {"type": "string"}}}},
        });
        close_objects(&mut s);
        assert_eq!(s["additionalProperties"], json!(false));
        assert_eq!(s["$defs"]["Person"]["additionalProperties"], json!(false));
        assert_eq!(
            s["properties"]["labels"]["additionalProperties"],
            json!({"type": "string"})
        );
        assert_eq!(
            s["properties"]["extra"]["additionalProperties"],
            json!(true)
        );
        assert_eq!(
            s["properties"]["tuple"]["prefixItems"][0]["additionalProperties"],
            json!(false)
        );
        // Not object schemas: untouched.
        assert!(s["properties"]["people"]
            .get("additionalProperties")
            .is_none());
        assert_eq!(
            s["properties"]["backup"]["anyOf"][1],
            json!({"type": "null"})
        );
    }

    #[test]
    fn members_of_an_intersection_stay_open() {
        let mut s = json!({"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}], "type": "object"});
        close_objects(&mut s);
        assert!(s.get("additionalProperties").is_none());
        assert!(
            s["allOf"][0].get("additionalProperties").is_none()
                && s["allOf"][1].get("additionalProperties").is_none()
        );
        // pydantic's wrapper of one reference (a description beside a `$ref`) is closed.
        let mut s =
            json!({"allOf": [{"type": "object", "properties": {"a": {}}}], "description": "d"});
        close_objects(&mut s);
        assert_eq!(s["allOf"][0]["additionalProperties"], json!(false));
        let mut b = json!(true);
        close_objects(&mut b);
        assert_eq!(b, json!(true));
    }
}
