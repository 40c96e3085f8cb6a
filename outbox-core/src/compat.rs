//! The compatibility check: a router's catalog against a committed snapshot of what it was.
//!
//! Event types, versions and subscriber names are stored with events and deliveries, which
//! outlive the code that wrote them. The snapshot (a JSON file in the repository) records, for
//! every event type, the JSON Schema and a sample `data` of every version it ever had, and every
//! subscriber name. The check fails, saying what to do, when the current code
//!
//! - cannot decode a recorded sample any more (a removed upcaster, a field renamed without a
//!   version bump): stored events would become dead letters;
//! - changed the shape of its current version without a version bump;
//! - lost an event type or a subscriber name without declaring the rename (`formerly`): stored
//!   events would be parked for ever, stored deliveries never delivered;
//! - has events, versions or subscribers the snapshot does not record yet.
//!
//! `OUTBOX_BLESS=1` records the current catalog into the snapshot, keeping every version it
//! recorded before; it refuses to record a breaking change. See
//! [`check_catalog`](crate::testing::check_catalog).

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use serde_json::{Map, Value, json};

use crate::catalog::{Catalog, CatalogEvent};

/// What the check found: breaking changes, and what the snapshot does not record yet.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CatalogReport {
    /// Changes that would break stored events or deliveries; blessing refuses them.
    pub breaking: Vec<String>,
    /// What the snapshot does not record yet (new events, versions, subscribers, an accepted
    /// shape): blessing records them.
    pub unrecorded: Vec<String>,
}

impl CatalogReport {
    /// Whether the catalog matches its snapshot.
    pub fn is_clean(&self) -> bool {
        self.breaking.is_empty() && self.unrecorded.is_empty()
    }
}

impl fmt::Display for CatalogReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for problem in &self.breaking {
            writeln!(f, "- {problem}")?;
        }
        for problem in &self.unrecorded {
            writeln!(f, "- {problem}")?;
        }
        Ok(())
    }
}

/// The snapshot's entry of one event type.
#[derive(Debug, Clone, Default)]
struct EventEntry {
    formerly: Vec<String>,
    /// version -> (schema, sample)
    versions: BTreeMap<u32, (Value, Value)>,
}

/// A parsed snapshot.
#[derive(Debug, Clone, Default)]
struct Snapshot {
    events: BTreeMap<String, EventEntry>,
    /// subscriber name -> former names
    subscribers: BTreeMap<String, Vec<String>>,
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .map(|names| {
            names
                .iter()
                .filter_map(|n| n.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

impl Snapshot {
    fn parse(value: &Value) -> Result<Self, String> {
        let events = value["events"]
            .as_object()
            .ok_or("the snapshot has no `events` object")?;
        let mut snapshot = Snapshot::default();
        for (name, entry) in events {
            let versions = entry["versions"]
                .as_object()
                .ok_or_else(|| format!("event `{name}` has no `versions` object"))?;
            let mut parsed = BTreeMap::new();
            for (version, recorded) in versions {
                let number: u32 = version
                    .parse()
                    .map_err(|_| format!("event `{name}`: `{version}` is not a version number"))?;
                parsed.insert(
                    number,
                    (recorded["schema"].clone(), recorded["sample"].clone()),
                );
            }
            snapshot.events.insert(
                name.clone(),
                EventEntry {
                    formerly: strings(&entry["formerly"]),
                    versions: parsed,
                },
            );
        }
        if let Some(subscribers) = value["subscribers"].as_object() {
            for (name, entry) in subscribers {
                snapshot
                    .subscribers
                    .insert(name.clone(), strings(&entry["formerly"]));
            }
        }
        Ok(snapshot)
    }

    fn to_value(&self, router: &str) -> Value {
        let events: Map<String, Value> = self
            .events
            .iter()
            .map(|(name, entry)| {
                let versions: Map<String, Value> = entry
                    .versions
                    .iter()
                    .map(|(v, (schema, sample))| {
                        (v.to_string(), json!({"schema": schema, "sample": sample}))
                    })
                    .collect();
                (
                    name.clone(),
                    json!({"formerly": entry.formerly, "versions": versions}),
                )
            })
            .collect();
        let subscribers: Map<String, Value> = self
            .subscribers
            .iter()
            .map(|(name, formerly)| (name.clone(), json!({ "formerly": formerly })))
            .collect();
        json!({
            "about": "The durable names and payload versions of this router, checked by \
                      outbox_core::testing::check_catalog. Written by OUTBOX_BLESS=1; commit it.",
            "router": router,
            "events": events,
            "subscribers": subscribers,
        })
    }
}

/// Compares `catalog` with the snapshot `snapshot` (as [`bless`] writes it).
pub fn compare(catalog: &Catalog, snapshot: &Value) -> Result<CatalogReport, String> {
    compare_noting_shapes(catalog, snapshot).map(|(report, _)| report)
}

/// [`compare`], and which of the breaking problems are changes of a current version's shape
/// (by index): the ones blessing may accept.
fn compare_noting_shapes(
    catalog: &Catalog,
    snapshot: &Value,
) -> Result<(CatalogReport, Vec<usize>), String> {
    let snapshot = Snapshot::parse(snapshot)?;
    let mut report = CatalogReport::default();
    let mut shape_changes = Vec::new();
    compare_events(catalog, &snapshot, &mut report, &mut shape_changes);
    compare_subscribers(catalog, &snapshot, &mut report);
    Ok((report, shape_changes))
}

fn compare_events(
    catalog: &Catalog,
    snapshot: &Snapshot,
    report: &mut CatalogReport,
    shape_changes: &mut Vec<usize>,
) {
    for (name, entry) in &snapshot.events {
        let stored_names = std::iter::once(name).chain(&entry.formerly);
        for stored in stored_names {
            if catalog.event(stored).is_none() {
                report.breaking.push(format!(
                    "event type `{stored}` is gone from the catalog: events stored under that \
                     name would be parked for ever. If the type was renamed, declare \
                     `#[outbox(formerly = [\"{stored}\"])]` on the type that replaces it; if it \
                     was retired and no stored event has that name any more, delete it from \
                     the snapshot by hand"
                ));
            }
        }
        let Some(event) = catalog.event(name) else {
            continue;
        };
        for (&version, (_, sample)) in &entry.versions {
            if let Err(error) = event.decode_data(name, version, sample) {
                report
                    .breaking
                    .push(undecodable(event, name, version, &error.to_string()));
            }
        }
    }
    for event in catalog.events() {
        let recorded = snapshot.events.get(event.event_type);
        let Some(schema) = event.schema() else {
            report.breaking.push(format!(
                "event `{}` does not derive `schemars::JsonSchema`: its shape cannot be pinned; \
                 derive it beside `OutboxEvent`",
                event.event_type
            ));
            continue;
        };
        match recorded.and_then(|entry| entry.versions.get(&event.version)) {
            None => report.unrecorded.push(format!(
                "`{}` version {} is not recorded in the snapshot: run the test with \
                 OUTBOX_BLESS=1 and commit the snapshot",
                event.event_type, event.version
            )),
            Some((old, _)) if shape(old) != shape(&schema) => {
                shape_changes.push(report.breaking.len());
                report.breaking.push(format!(
                    "the shape of `{t}` version {v} changed without a version bump ({diff}): \
                 events stored at version {v} may no longer decode. Bump it to \
                 `#[outbox(version = {next})]` and add `#[outbox(upcast(from = {v}, with = \
                 ...))]`, a function that turns version {v} data into version {next} data; if \
                 every stored payload still decodes as it is (a new optional field, say), \
                 record the new shape with OUTBOX_BLESS=1",
                    t = event.event_type,
                    v = event.version,
                    next = event.version + 1,
                    diff = shape_diff(old, &schema),
                ));
            }
            Some(_) => {}
        }
        if let Some(newest) = recorded.and_then(|entry| entry.versions.keys().next_back())
            && *newest > event.version
        {
            report.breaking.push(format!(
                "`{}` is at version {}, but version {newest} was recorded: stored events of \
                 version {newest} would be parked for ever; versions only go up",
                event.event_type, event.version
            ));
        }
        if recorded.is_none()
            && event
                .formerly
                .iter()
                .all(|f| !snapshot.events.contains_key(*f))
        {
            report.unrecorded.push(format!(
                "event type `{}` is new: run the test with OUTBOX_BLESS=1 and commit the \
                 snapshot",
                event.event_type
            ));
        }
        if let Some(entry) = recorded {
            for name in event.formerly {
                if !entry.formerly.iter().any(|f| f == name) {
                    report.unrecorded.push(format!(
                        "`{}` now declares `formerly = [\"{name}\"]`: record it with \
                         OUTBOX_BLESS=1",
                        event.event_type
                    ));
                }
            }
        }
    }
}

/// The message of a recorded sample that no longer decodes.
fn undecodable(event: &CatalogEvent, name: &str, version: u32, error: &str) -> String {
    if version < event.oldest_readable_version {
        format!(
            "stored `{name}` payloads of version {version} no longer decode: this build reads \
             versions {}..={} only, so the upcaster from version {version} is gone and such \
             events would be dead letters. Restore `#[outbox(upcast(from = {version}, with = \
             ...))]` on `{}`",
            event.oldest_readable_version, event.version, event.event_type
        )
    } else if version > event.version {
        format!(
            "stored `{name}` payloads of version {version} are newer than this build's version \
             {}: such events would be parked for ever",
            event.version
        )
    } else {
        format!(
            "the recorded sample of `{name}` version {version} no longer decodes ({error}): \
             events stored at version {version} would be dead letters. If the shape changed, \
             bump the version and add an upcaster from the old one instead"
        )
    }
}

fn compare_subscribers(catalog: &Catalog, snapshot: &Snapshot, report: &mut CatalogReport) {
    for (name, formerly) in &snapshot.subscribers {
        for stored in std::iter::once(name).chain(formerly) {
            if catalog.subscriber(stored).is_none() {
                report.breaking.push(format!(
                    "subscriber `{stored}` is gone from the router: deliveries stored under \
                     that name would never be delivered. If it was renamed, declare \
                     `#[subscriber(formerly = [\"{stored}\"])]` on the renamed one (or \
                     `const FORMERLY` of an observer); if it was removed and no delivery of \
                     it is left (`outbox status`), delete it from the snapshot by hand"
                ));
            }
        }
    }
    for subscriber in catalog.subscribers() {
        let known = subscriber
            .names()
            .any(|n| snapshot.subscribers.contains_key(n));
        let recorded = snapshot.subscribers.get(subscriber.name);
        if !known {
            report.unrecorded.push(format!(
                "subscriber `{}` is new: run the test with OUTBOX_BLESS=1 and commit the \
                 snapshot",
                subscriber.name
            ));
        } else if recorded.is_none_or(|formerly| {
            subscriber
                .formerly
                .iter()
                .any(|f| !formerly.iter().any(|r| r == f))
        }) {
            report.unrecorded.push(format!(
                "subscriber `{}` was renamed: record it with OUTBOX_BLESS=1",
                subscriber.name
            ));
        }
    }
}

/// A schema without its annotations (descriptions, titles, examples, comments): what decoding
/// depends on, so that editing a doc comment is not a change of shape.
fn shape(schema: &Value) -> Value {
    const ANNOTATIONS: &[&str] = &["description", "title", "examples", "$comment", "$schema"];
    const SCHEMA_MAPS: &[&str] = &[
        "properties",
        "patternProperties",
        "$defs",
        "definitions",
        "dependentSchemas",
    ];
    const SCHEMA_LISTS: &[&str] = &["allOf", "anyOf", "oneOf", "prefixItems"];
    let Some(object) = schema.as_object() else {
        return schema.clone();
    };
    let mut out = Map::new();
    for (key, value) in object {
        let key_str = key.as_str();
        if ANNOTATIONS.contains(&key_str) {
            continue;
        }
        let value = if SCHEMA_MAPS.contains(&key_str) {
            match value.as_object() {
                Some(map) => Value::Object(
                    map.iter()
                        .map(|(name, sub)| (name.clone(), shape(sub)))
                        .collect(),
                ),
                None => value.clone(),
            }
        } else if SCHEMA_LISTS.contains(&key_str) {
            match value.as_array() {
                Some(list) => list.iter().map(shape).collect(),
                None => value.clone(),
            }
        } else if value.is_object() && !matches!(key_str, "const" | "default" | "enum") {
            // A single subschema: `items`, `additionalProperties`, `not`, `if`, ...
            shape(value)
        } else {
            value.clone()
        };
        out.insert(key.clone(), value);
    }
    Value::Object(out)
}

/// Which top-level fields a shape gained, lost or made required.
fn shape_diff(old: &Value, new: &Value) -> String {
    let fields = |schema: &Value| -> Vec<String> {
        schema["properties"]
            .as_object()
            .map(|p| p.keys().cloned().collect())
            .unwrap_or_default()
    };
    let (old_fields, new_fields) = (fields(old), fields(new));
    let added: Vec<&String> = new_fields
        .iter()
        .filter(|f| !old_fields.contains(f))
        .collect();
    let removed: Vec<&String> = old_fields
        .iter()
        .filter(|f| !new_fields.contains(f))
        .collect();
    let mut parts = Vec::new();
    if !added.is_empty() {
        parts.push(format!("fields added: {}", quoted(&added)));
    }
    if !removed.is_empty() {
        parts.push(format!("fields removed: {}", quoted(&removed)));
    }
    if parts.is_empty() {
        parts.push("field types or constraints differ".to_owned());
    }
    parts.join("; ")
}

fn quoted(names: &[&String]) -> String {
    names
        .iter()
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The snapshot of `catalog`: `previous` (if any) with the current catalog recorded into it.
/// Every version recorded before is kept; a renamed event type's or subscriber's entry moves to
/// its new name with the old name in `formerly`. Refuses (with the report) when the catalog
/// breaks what `previous` records, except a changed shape at the same version whose recorded
/// samples still decode (the caller's explicit acceptance).
pub fn bless(catalog: &Catalog, previous: Option<&Value>) -> Result<Value, String> {
    let snapshot = match previous {
        Some(previous) => {
            let (report, shape_changes) = compare_noting_shapes(catalog, previous)?;
            let refused: Vec<&String> = report
                .breaking
                .iter()
                .enumerate()
                .filter(|(index, _)| !shape_changes.contains(index))
                .map(|(_, problem)| problem)
                .collect();
            if !refused.is_empty() {
                return Err(format!(
                    "refusing to record a catalog that breaks stored events or deliveries:\n{}",
                    refused
                        .iter()
                        .map(|p| format!("- {p}"))
                        .collect::<Vec<_>>()
                        .join("\n")
                ));
            }
            Snapshot::parse(previous)?
        }
        None => Snapshot::default(),
    };
    let mut next = Snapshot::default();
    for event in catalog.events() {
        let mut entry = EventEntry {
            formerly: event.formerly.iter().map(|f| (*f).to_owned()).collect(),
            versions: BTreeMap::new(),
        };
        for name in event.names() {
            if let Some(old) = snapshot.events.get(name) {
                for (version, recorded) in &old.versions {
                    entry
                        .versions
                        .entry(*version)
                        .or_insert_with(|| recorded.clone());
                }
                for former in &old.formerly {
                    if !entry.formerly.contains(former) {
                        entry.formerly.push(former.clone());
                    }
                }
            }
        }
        let schema = event.schema().ok_or_else(|| {
            format!(
                "event `{}` does not derive `schemars::JsonSchema`: derive it beside \
                 `OutboxEvent` so that its shape can be recorded",
                event.event_type
            )
        })?;
        let sample = match entry.versions.get(&event.version) {
            Some((_, sample)) => sample.clone(),
            None => {
                let sample = sample_of(&schema);
                event
                    .decode_data(event.event_type, event.version, &sample)
                    .map_err(|error| {
                        format!(
                            "could not make a sample of `{}` version {} from its schema ({error}): \
                             write one by hand in the snapshot, as `events.{}.versions.{}.sample`",
                            event.event_type, event.version, event.event_type, event.version
                        )
                    })?;
                sample
            }
        };
        entry.versions.insert(event.version, (schema, sample));
        next.events.insert(event.event_type.to_owned(), entry);
    }
    for subscriber in catalog.subscribers() {
        let mut formerly: Vec<String> = subscriber
            .formerly
            .iter()
            .map(|f| (*f).to_owned())
            .collect();
        for name in subscriber.names() {
            for former in snapshot.subscribers.get(name).into_iter().flatten() {
                if !formerly.contains(former) {
                    formerly.push(former.clone());
                }
            }
        }
        next.subscribers
            .insert(subscriber.name.to_owned(), formerly);
    }
    Ok(next.to_value(catalog.router()))
}

/// Checks `catalog` against the snapshot at `path`, or records it there when `bless` is true.
pub(crate) fn check_file(catalog: &Catalog, path: &Path, bless_it: bool) -> Result<(), String> {
    let shown = path.display();
    let previous = match std::fs::read_to_string(path) {
        Ok(text) => Some(
            serde_json::from_str::<Value>(&text)
                .map_err(|e| format!("the catalog snapshot {shown} is not JSON: {e}"))?,
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(format!("cannot read the catalog snapshot {shown}: {e}")),
    };
    if bless_it {
        let next = bless(catalog, previous.as_ref())?;
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)
                .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        }
        let text = serde_json::to_string_pretty(&next).expect("JSON values serialize") + "\n";
        return std::fs::write(path, text).map_err(|e| format!("cannot write {shown}: {e}"));
    }
    let Some(previous) = previous else {
        return Err(format!(
            "no catalog snapshot at {shown}: run the test with OUTBOX_BLESS=1 to record one, \
             and commit it"
        ));
    };
    let report = compare(catalog, &previous).map_err(|error| {
        format!("the catalog snapshot {shown} cannot be read: {error}; record it again with OUTBOX_BLESS=1")
    })?;
    if report.is_clean() {
        Ok(())
    } else {
        Err(format!(
            "the catalog of router `{}` does not match its snapshot {shown}:\n{report}",
            catalog.router()
        ))
    }
}

/// A value that satisfies `schema` (as schemars writes schemas), for a sample payload: every
/// property present, the first alternative of a choice, the smallest allowed number, empty or
/// formatted strings. `None`-able values are given a value, so that the sample exercises them.
pub fn sample_of(schema: &Value) -> Value {
    sample_in(schema, schema, 0)
}

fn sample_in(schema: &Value, root: &Value, depth: usize) -> Value {
    const MAX_DEPTH: usize = 16;
    if depth > MAX_DEPTH {
        return Value::Null;
    }
    let Some(object) = schema.as_object() else {
        // `true` (anything): a null is as good as any.
        return Value::Null;
    };
    if let Some(reference) = object.get("$ref").and_then(Value::as_str) {
        let target = reference
            .strip_prefix('#')
            .and_then(|pointer| root.pointer(pointer))
            .unwrap_or(&Value::Null);
        return sample_in(target, root, depth + 1);
    }
    if let Some(value) = object.get("const") {
        return value.clone();
    }
    if let Some(first) = object.get("enum").and_then(|e| e.as_array()?.first()) {
        return first.clone();
    }
    for choice in ["oneOf", "anyOf"] {
        if let Some(options) = object.get(choice).and_then(Value::as_array) {
            let option = options
                .iter()
                .find(|o| o.get("type") != Some(&json!("null")))
                .or_else(|| options.first());
            return option.map_or(Value::Null, |o| sample_in(o, root, depth + 1));
        }
    }
    if let Some(parts) = object.get("allOf").and_then(Value::as_array) {
        let mut merged = Map::new();
        for part in parts {
            if let Value::Object(fields) = sample_in(part, root, depth + 1) {
                merged.extend(fields);
            }
        }
        return Value::Object(merged);
    }
    let kind = match object.get("type") {
        Some(Value::String(kind)) => kind.as_str(),
        Some(Value::Array(kinds)) => kinds
            .iter()
            .filter_map(Value::as_str)
            .find(|k| *k != "null")
            .unwrap_or("null"),
        _ if object.contains_key("properties") => "object",
        _ => "null",
    };
    match kind {
        "object" => {
            let mut fields = Map::new();
            if let Some(properties) = object.get("properties").and_then(Value::as_object) {
                for (name, property) in properties {
                    fields.insert(name.clone(), sample_in(property, root, depth + 1));
                }
            }
            Value::Object(fields)
        }
        "array" => {
            let count = object.get("minItems").and_then(Value::as_u64).unwrap_or(1);
            match object.get("prefixItems").and_then(Value::as_array) {
                Some(items) => items
                    .iter()
                    .map(|i| sample_in(i, root, depth + 1))
                    .collect(),
                None => {
                    let item = object.get("items").cloned().unwrap_or(Value::Null);
                    (0..count)
                        .map(|_| sample_in(&item, root, depth + 1))
                        .collect()
                }
            }
        }
        "string" => Value::String(match object.get("format").and_then(Value::as_str) {
            Some("uuid") => "00000000-0000-0000-0000-000000000000".to_owned(),
            Some("date-time") => "1970-01-01T00:00:00Z".to_owned(),
            Some("date") => "1970-01-01".to_owned(),
            Some("time") => "00:00:00".to_owned(),
            Some("email") => "someone@example.com".to_owned(),
            Some("uri") => "https://example.com/".to_owned(),
            _ => {
                let length = object.get("minLength").and_then(Value::as_u64).unwrap_or(0);
                "x".repeat(usize::try_from(length).unwrap_or(0))
            }
        }),
        "integer" => {
            let minimum = object.get("minimum").and_then(Value::as_i64).unwrap_or(0);
            json!(minimum.max(0))
        }
        "number" => {
            let minimum = object.get("minimum").and_then(Value::as_f64).unwrap_or(0.0);
            json!(minimum.max(0.0))
        }
        "boolean" => Value::Bool(false),
        _ => Value::Null,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::sample_of;

    #[test]
    fn a_sample_satisfies_what_schemars_writes() {
        let schema = json!({
            "type": "object",
            "properties": {
                "id": {"type": "string", "format": "uuid"},
                "at": {"type": "string", "format": "date-time"},
                "count": {"type": "integer", "format": "uint32", "minimum": 0},
                "note": {"type": ["string", "null"]},
                "tags": {"type": "array", "items": {"type": "string"}},
                "kind": {"$ref": "#/$defs/Kind"},
                "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "boolean"}]},
            },
            "$defs": {"Kind": {"oneOf": [{"const": "a"}, {"const": "b"}]}},
        });
        assert_eq!(
            sample_of(&schema),
            json!({
                "id": "00000000-0000-0000-0000-000000000000",
                "at": "1970-01-01T00:00:00Z",
                "count": 0,
                "note": "",
                "tags": [""],
                "kind": "a",
                "pair": [0, false],
            })
        );
    }

    #[test]
    fn a_shape_ignores_annotations_but_not_fields_named_like_them() {
        let documented = json!({
            "title": "Plan", "description": "a plan",
            "properties": {
                "title": {"type": "string", "description": "its title"},
                "tags": {"type": "array", "items": {"type": "string", "description": "a tag"}},
            },
        });
        let bare = json!({
            "properties": {
                "title": {"type": "string"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
        });
        assert_eq!(super::shape(&documented), super::shape(&bare));
        let without_title_field = json!({"properties": {"tags": bare["properties"]["tags"]}});
        assert_ne!(super::shape(&bare), super::shape(&without_title_field));
    }

    #[test]
    fn a_recursive_schema_gives_a_finite_sample() {
        let schema = json!({
            "$ref": "#/$defs/Node",
            "$defs": {"Node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/Node"}}}},
        });
        assert!(sample_of(&schema).is_object());
    }
}
