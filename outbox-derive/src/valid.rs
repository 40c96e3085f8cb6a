//! Checks what the outbox attributes say and turns them into the values the expansion needs.

use std::collections::BTreeSet;

use syn::ext::IdentExt;
use syn::{Ident, LitInt, Path, Type};

use crate::ast::{Event, Field};
use crate::attr;
use crate::ctxt::Errors;

/// A checked event: everything `expand.rs` needs.
pub(crate) struct Checked<'a> {
    pub(crate) krate: Path,
    pub(crate) aggregate_type: String,
    pub(crate) event_type: String,
    /// Its earlier names.
    pub(crate) formerly: Vec<String>,
    pub(crate) version: u32,
    /// `(from, with)`, in ascending `from` order.
    pub(crate) upcasts: Vec<(u32, &'a Path)>,
    pub(crate) aggregate_id: (&'a Ident, &'a Type),
    pub(crate) occurred_at: Option<(&'a Ident, &'a Type)>,
}

/// The path of the runtime crate, `::outbox_core` unless `#[outbox(crate = "...")]` says otherwise.
pub(crate) fn krate(event: &Event<'_>) -> Path {
    attr::krate_or_default(event.attrs.krate.as_ref())
}

/// Checks the event; `None` if any check failed (the errors are recorded).
pub(crate) fn check<'a>(event: &'a Event<'a>, errors: &mut Errors) -> Option<Checked<'a>> {
    let ident = &event.input.ident;
    let attrs = &event.attrs;

    let aggregate_type = match &attrs.aggregate_type {
        Some(lit) => attr::check_name(lit, "aggregate_type", errors),
        None => {
            errors.spanned(
                ident,
                "missing `#[outbox(aggregate_type = \"...\")]`: name the kind of aggregate this \
                 event belongs to, like `aggregate_type = \"subscription\"`",
            );
            None
        }
    };
    let event_type = match &attrs.event_type {
        Some(lit) => attr::check_name(lit, "event_type", errors),
        None => Some(ident.unraw().to_string()),
    };
    let formerly = match &attrs.formerly {
        Some(names) => attr::check_formerly(names, event_type.as_deref(), "event_type", errors),
        None => Some(Vec::new()),
    };
    let version = match &attrs.version {
        Some(lit) => version(lit, errors),
        None => Some(1),
    };
    let upcasts = version.map(|version| upcasts(event, version, errors));

    let (aggregate_id, occurred_at) = match &event.fields {
        Some(fields) => (
            aggregate_id_field(event, fields, errors),
            occurred_at_field(fields, errors),
        ),
        // The item's shape is already reported; do not add errors about its fields.
        None => (None, Ok(None)),
    };

    Some(Checked {
        krate: krate(event),
        aggregate_type: aggregate_type?,
        event_type: event_type?,
        formerly: formerly?,
        version: version?,
        upcasts: upcasts??,
        aggregate_id: aggregate_id?,
        occurred_at: occurred_at.ok()?,
    })
}

/// A version number: a `u32` literal of at least 1.
fn version_number(lit: &LitInt, what: &str, errors: &mut Errors) -> Option<u32> {
    if !matches!(lit.suffix(), "" | "u32") {
        errors.spanned(
            lit,
            format!("`{what}` is a `u32`: drop the `{}` suffix", lit.suffix()),
        );
        return None;
    }
    match lit.base10_parse::<u32>() {
        Ok(0) => {
            errors.spanned(
                lit,
                format!("`{what}` must be at least 1: payload versions count from 1"),
            );
            None
        }
        Ok(n) => Some(n),
        Err(_) => {
            errors.spanned(lit, format!("`{what}` must fit in a `u32`"));
            None
        }
    }
}

fn version(lit: &LitInt, errors: &mut Errors) -> Option<u32> {
    version_number(lit, "version", errors)
}

/// The upcasters, checked against `version`: each below it, no duplicates, no gaps up to it.
fn upcasts<'a>(
    event: &'a Event<'a>,
    version: u32,
    errors: &mut Errors,
) -> Option<Vec<(u32, &'a Path)>> {
    let mut ok = true;
    let mut steps = Vec::new();
    let mut seen = BTreeSet::new();
    for upcast in &event.attrs.upcasts {
        let Some(from) = version_number(&upcast.from, "from", errors) else {
            ok = false;
            continue;
        };
        if from >= version {
            errors.spanned(
                &upcast.from,
                format!(
                    "an upcaster turns version `from` into `from + 1`, so `from` must be below \
                     the event's version {version}{}",
                    if event.attrs.version.is_none() {
                        "; declare the current version with `version = N`"
                    } else {
                        ""
                    }
                ),
            );
            ok = false;
        } else if !seen.insert(from) {
            errors.spanned(
                &upcast.keyword,
                format!("duplicate upcaster `from = {from}`: each version has one step"),
            );
            ok = false;
        } else {
            steps.push((from, &upcast.with));
        }
    }
    if let Some(&oldest) = seen.first() {
        let missing: Vec<String> = (oldest..version)
            .filter(|v| !seen.contains(v))
            .map(|v| format!("`upcast(from = {v}, with = ...)`"))
            .collect();
        if !missing.is_empty() {
            let message = format!(
                "upcasters must form an unbroken chain from version {oldest} up to version \
                 {version}: add {}",
                missing.join(" and ")
            );
            match &event.attrs.version {
                Some(lit) => errors.spanned(lit, message),
                None => errors.spanned(&event.input.ident, message),
            }
            ok = false;
        }
    }
    steps.sort_by_key(|&(from, _)| from);
    ok.then_some(steps)
}

fn aggregate_id_field<'a>(
    event: &Event<'a>,
    fields: &'a [Field<'a>],
    errors: &mut Errors,
) -> Option<(&'a Ident, &'a Type)> {
    let mut marked = fields.iter().filter(|f| f.attrs.aggregate_id.is_some());
    let first = marked.next();
    let mut ok = true;
    for extra in marked {
        errors.spanned(
            &extra.attrs.aggregate_id,
            format!(
                "an event has one aggregate id: `#[outbox(aggregate_id)]` is already on field `{}`",
                first.map_or(String::new(), |f| f.ident.to_string())
            ),
        );
        ok = false;
    }
    match first {
        Some(field) if ok => {
            if field.attrs.occurred_at.is_some() {
                errors.spanned(
                    &field.attrs.occurred_at,
                    "a field cannot be both the aggregate id and `occurred_at`",
                );
                return None;
            }
            Some((field.ident, field.ty))
        }
        Some(_) => None,
        None => {
            errors.spanned(
                &event.input.ident,
                "`#[derive(OutboxEvent)]` needs the aggregate id: mark the `Uuid` field that \
                 identifies the aggregate with `#[outbox(aggregate_id)]`",
            );
            None
        }
    }
}

/// The `#[outbox(occurred_at)]` field, if any; `Err` when more than one is marked.
fn occurred_at_field<'a>(
    fields: &'a [Field<'a>],
    errors: &mut Errors,
) -> Result<Option<(&'a Ident, &'a Type)>, ()> {
    let mut marked = fields.iter().filter(|f| f.attrs.occurred_at.is_some());
    let first = marked.next();
    let mut ok = true;
    for extra in marked {
        errors.spanned(
            &extra.attrs.occurred_at,
            format!(
                "`#[outbox(occurred_at)]` is already on field `{}`",
                first.map_or(String::new(), |f| f.ident.to_string())
            ),
        );
        ok = false;
    }
    if ok {
        Ok(first.map(|f| (f.ident, f.ty)))
    } else {
        Err(())
    }
}
