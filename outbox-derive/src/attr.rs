//! Parsing of `#[outbox(...)]` attributes: keys, duplicates and the kind of each value. What the
//! values mean is checked in `valid.rs`.

use proc_macro2::{Span, TokenStream, TokenTree};
use quote::ToTokens;
use syn::meta::ParseNestedMeta;
use syn::punctuated::Punctuated;
use syn::{Attribute, LitInt, LitStr, Path, Token, Type, parse_quote};

use crate::ctxt::Errors;

/// The keys an `#[outbox(...)]` attribute on the struct may hold.
const CONTAINER_KEYS: &str =
    "`aggregate_type`, `event_type`, `formerly`, `version`, `upcast` or `crate`";
/// The keys an `#[outbox(...)]` attribute on a field may hold.
const FIELD_KEYS: &str = "`aggregate_id` or `occurred_at`";

/// `#[outbox(...)]` on the struct.
#[derive(Default)]
pub(crate) struct ContainerAttrs {
    pub(crate) aggregate_type: Option<LitStr>,
    pub(crate) event_type: Option<LitStr>,
    /// `formerly = ["OldName"]`: the event type's earlier names.
    pub(crate) formerly: Option<Vec<LitStr>>,
    pub(crate) version: Option<LitInt>,
    pub(crate) upcasts: Vec<Upcast>,
    pub(crate) krate: Option<Path>,
}

/// One `upcast(from = K, with = path)`.
pub(crate) struct Upcast {
    /// The `upcast` keyword, for errors about the whole step.
    pub(crate) keyword: Path,
    pub(crate) from: LitInt,
    pub(crate) with: Path,
}

/// `#[outbox(...)]` on a field; each holds the keyword's path, for spans.
#[derive(Default)]
pub(crate) struct FieldAttrs {
    pub(crate) aggregate_id: Option<Path>,
    pub(crate) occurred_at: Option<Path>,
}

pub(crate) fn container(attrs: &[Attribute], errors: &mut Errors) -> ContainerAttrs {
    let mut out = ContainerAttrs::default();
    let mut seen = Seen::default();
    for attr in outbox_attrs(attrs) {
        let parsed = attr.parse_nested_meta(|meta| {
            let key = &meta.path;
            if key.is_ident("aggregate_type") {
                let value = string_value(&meta, "aggregate_type = \"subscription\"", errors)?;
                if seen.first(key, errors) {
                    out.aggregate_type = value;
                }
            } else if key.is_ident("event_type") {
                let value = string_value(&meta, "event_type = \"PaymentSucceeded\"", errors)?;
                if seen.first(key, errors) {
                    out.event_type = value;
                }
            } else if key.is_ident("formerly") {
                let value = string_list(&meta, "formerly = [\"PaymentSucceeded\"]", errors)?;
                if seen.first(key, errors) {
                    out.formerly = value;
                }
            } else if key.is_ident("version") {
                let value = int_value(&meta, "version = 2", errors)?;
                if seen.first(key, errors) {
                    out.version = value;
                }
            } else if key.is_ident("upcast") {
                if let Some(upcast) = upcast(&meta, errors)? {
                    out.upcasts.push(upcast);
                }
            } else if key.is_ident("crate") {
                let value = path_value(&meta, "crate = \"my_app::outbox_core\"", errors)?;
                if seen.first(key, errors) {
                    out.krate = value;
                }
            } else {
                let hint = if is_any(key, &["aggregate_id", "occurred_at"]) {
                    format!("; `{}` belongs on a field", key_name(key))
                } else {
                    String::new()
                };
                errors.spanned(
                    key,
                    format!(
                        "unknown outbox attribute `{}`: expected {CONTAINER_KEYS}{hint}",
                        key_name(key)
                    ),
                );
                skip_value(&meta)?;
            }
            Ok(())
        });
        if let Err(error) = parsed {
            errors.push(error);
        }
    }
    out
}

pub(crate) fn field(attrs: &[Attribute], errors: &mut Errors) -> FieldAttrs {
    let mut out = FieldAttrs::default();
    let mut seen = Seen::default();
    for attr in outbox_attrs(attrs) {
        let parsed = attr.parse_nested_meta(|meta| {
            let key = &meta.path;
            let slot = if key.is_ident("aggregate_id") {
                Some(&mut out.aggregate_id)
            } else if key.is_ident("occurred_at") {
                Some(&mut out.occurred_at)
            } else {
                None
            };
            match slot {
                Some(_) if !meta.input.is_empty() && !meta.input.peek(Token![,]) => {
                    errors.spanned(
                        key,
                        format!(
                            "`{}` takes no value: write `#[outbox({})]`",
                            key_name(key),
                            key_name(key)
                        ),
                    );
                    skip_value(&meta)?;
                }
                Some(slot) => {
                    if seen.first(key, errors) {
                        *slot = Some(key.clone());
                    }
                }
                None => {
                    let hint = if is_any(
                        key,
                        &[
                            "aggregate_type",
                            "event_type",
                            "formerly",
                            "version",
                            "upcast",
                            "crate",
                        ],
                    ) {
                        format!("; `{}` belongs on the struct", key_name(key))
                    } else {
                        String::new()
                    };
                    errors.spanned(
                        key,
                        format!(
                            "unknown outbox field attribute `{}`: expected {FIELD_KEYS}{hint}",
                            key_name(key)
                        ),
                    );
                    skip_value(&meta)?;
                }
            }
            Ok(())
        });
        if let Err(error) = parsed {
            errors.push(error);
        }
    }
    out
}

fn outbox_attrs(attrs: &[Attribute]) -> impl Iterator<Item = &Attribute> {
    attrs.iter().filter(|attr| attr.path().is_ident("outbox"))
}

/// `upcast(from = K, with = path)`; `None` when it is incomplete (the error is recorded).
fn upcast(meta: &ParseNestedMeta<'_>, errors: &mut Errors) -> syn::Result<Option<Upcast>> {
    let keyword = meta.path.clone();
    if !meta.input.peek(syn::token::Paren) {
        errors.spanned(
            &keyword,
            "expected `upcast(from = 1, with = path::to::function)`",
        );
        skip_value(meta)?;
        return Ok(None);
    }
    let mut from = None;
    let mut with = None;
    let mut seen = Seen::default();
    meta.parse_nested_meta(|inner| {
        let key = &inner.path;
        if key.is_ident("from") {
            let value = int_value(&inner, "from = 1", errors)?;
            if seen.first(key, errors) {
                from = value;
            }
        } else if key.is_ident("with") {
            let value = path_value(&inner, "with = path::to::function", errors)?;
            if seen.first(key, errors) {
                with = value;
            }
        } else {
            errors.spanned(
                key,
                format!(
                    "unknown `upcast` key `{}`: expected `from` or `with`",
                    key_name(key)
                ),
            );
            skip_value(&inner)?;
        }
        Ok(())
    })?;
    match (from, with) {
        (Some(from), Some(with)) => Ok(Some(Upcast {
            keyword,
            from,
            with,
        })),
        _ => {
            let missing = match (seen.contains("from"), seen.contains("with")) {
                // A key that is there but wrong has its own error.
                (true, true) => return Ok(None),
                (false, false) => "`from` and `with`",
                (false, true) => "`from`",
                (true, false) => "`with`",
            };
            errors.spanned(
                &keyword,
                format!("`upcast` needs {missing}: `upcast(from = 1, with = path::to::function)`"),
            );
            Ok(None)
        }
    }
}

/// The keys met so far in one attribute list (across all `#[outbox(...)]` of one item).
pub(crate) struct Seen {
    /// What the keys are called in errors, such as "outbox attribute".
    what: &'static str,
    keys: Vec<String>,
}

impl Default for Seen {
    fn default() -> Self {
        Self::new("outbox attribute")
    }
}

impl Seen {
    /// Keys of the attribute `what`.
    pub(crate) fn new(what: &'static str) -> Self {
        Self {
            what,
            keys: Vec::new(),
        }
    }

    /// Whether `key` is met for the first time; records a duplicate-key error if not.
    pub(crate) fn first(&mut self, key: &Path, errors: &mut Errors) -> bool {
        let name = key_name(key);
        if self.contains(&name) {
            errors.spanned(key, format!("duplicate {} `{name}`", self.what));
            false
        } else {
            self.keys.push(name);
            true
        }
    }

    fn contains(&self, name: &str) -> bool {
        self.keys.iter().any(|seen| seen == name)
    }
}

/// The tokens after `key =`, up to the next comma. `None` when they are missing (error recorded).
fn value_tokens(
    meta: &ParseNestedMeta<'_>,
    example: &str,
    errors: &mut Errors,
) -> syn::Result<Option<TokenStream>> {
    if !meta.input.peek(Token![=]) {
        errors.spanned(&meta.path, format!("expected a value: `{example}`"));
        skip_value(meta)?;
        return Ok(None);
    }
    let input = meta.value()?;
    let mut tokens = TokenStream::new();
    while !input.is_empty() && !input.peek(Token![,]) {
        tokens.extend([input.parse::<TokenTree>()?]);
    }
    if tokens.is_empty() {
        errors.spanned(&meta.path, format!("expected a value: `{example}`"));
        return Ok(None);
    }
    Ok(Some(tokens))
}

pub(crate) fn string_value(
    meta: &ParseNestedMeta<'_>,
    example: &str,
    errors: &mut Errors,
) -> syn::Result<Option<LitStr>> {
    let Some(tokens) = value_tokens(meta, example, errors)? else {
        return Ok(None);
    };
    Ok(syn::parse2::<LitStr>(tokens.clone())
        .map_err(|_| {
            errors.spanned(
                &tokens,
                format!(
                    "`{}` must be a string literal, like `{example}`",
                    key_name(&meta.path)
                ),
            );
        })
        .ok())
}

pub(crate) fn int_value(
    meta: &ParseNestedMeta<'_>,
    example: &str,
    errors: &mut Errors,
) -> syn::Result<Option<LitInt>> {
    let Some(tokens) = value_tokens(meta, example, errors)? else {
        return Ok(None);
    };
    Ok(syn::parse2::<LitInt>(tokens.clone())
        .map_err(|_| {
            errors.spanned(
                &tokens,
                format!(
                    "`{}` must be an integer literal, like `{example}`",
                    key_name(&meta.path)
                ),
            );
        })
        .ok())
}

/// A path, written bare (`with = a::b`) or quoted (`crate = "a::b"`).
pub(crate) fn path_value(
    meta: &ParseNestedMeta<'_>,
    example: &str,
    errors: &mut Errors,
) -> syn::Result<Option<Path>> {
    let Some(tokens) = value_tokens(meta, example, errors)? else {
        return Ok(None);
    };
    let parsed = match syn::parse2::<LitStr>(tokens.clone()) {
        Ok(lit) => lit.parse::<Path>(),
        Err(_) => syn::parse2::<Path>(tokens.clone()),
    };
    Ok(parsed
        .map_err(|_| {
            errors.spanned(
                &tokens,
                format!(
                    "`{}` must be a path, like `{example}`",
                    key_name(&meta.path)
                ),
            );
        })
        .ok())
}

/// Consumes whatever follows an unknown key: `= value` or `(...)`.
fn skip_value(meta: &ParseNestedMeta<'_>) -> syn::Result<()> {
    while !meta.input.is_empty() && !meta.input.peek(Token![,]) {
        meta.input.parse::<TokenTree>()?;
    }
    Ok(())
}

fn is_any(key: &Path, names: &[&str]) -> bool {
    names.iter().any(|name| key.is_ident(name))
}

fn key_name(key: &Path) -> String {
    match key.get_ident() {
        Some(ident) => ident.to_string(),
        None => key.to_token_stream().to_string().replace(' ', ""),
    }
}

/// `key = [A, B, C]`: a bracketed list of types, with the span of the brackets.
pub(crate) fn type_list(
    meta: &ParseNestedMeta<'_>,
    example: &str,
    errors: &mut Errors,
) -> syn::Result<Option<(Span, Vec<Type>)>> {
    let Some(tokens) = value_tokens(meta, example, errors)? else {
        return Ok(None);
    };
    let parsed = syn::parse::Parser::parse2(
        |input: syn::parse::ParseStream<'_>| {
            let content;
            let brackets = syn::bracketed!(content in input);
            let types = Punctuated::<Type, Token![,]>::parse_terminated(&content)?;
            Ok((brackets.span.join(), types.into_iter().collect()))
        },
        tokens.clone(),
    );
    Ok(parsed
        .map_err(|_| {
            errors.spanned(
                &tokens,
                format!(
                    "`{}` must be a list of types in brackets, like `{example}`",
                    key_name(&meta.path)
                ),
            );
        })
        .ok())
}

/// `key = ["a", "b"]`: a bracketed list of string literals.
pub(crate) fn string_list(
    meta: &ParseNestedMeta<'_>,
    example: &str,
    errors: &mut Errors,
) -> syn::Result<Option<Vec<LitStr>>> {
    let Some(tokens) = value_tokens(meta, example, errors)? else {
        return Ok(None);
    };
    let parsed = syn::parse::Parser::parse2(
        |input: syn::parse::ParseStream<'_>| {
            let content;
            syn::bracketed!(content in input);
            let names = Punctuated::<LitStr, Token![,]>::parse_terminated(&content)?;
            Ok(names.into_iter().collect())
        },
        tokens.clone(),
    );
    Ok(parsed
        .map_err(|_| {
            errors.spanned(
                &tokens,
                format!(
                    "`{}` must be a list of string literals in brackets, like `{example}`",
                    key_name(&meta.path)
                ),
            );
        })
        .ok())
}

/// Checks the names of `formerly = [...]`: each a valid stored name, none twice, none the
/// current name `current`. Returns the valid ones, or `None` if any is not.
pub(crate) fn check_formerly(
    names: &[LitStr],
    current: Option<&str>,
    key: &str,
    errors: &mut Errors,
) -> Option<Vec<String>> {
    let mut out: Vec<String> = Vec::new();
    let mut ok = true;
    for lit in names {
        let Some(name) = check_name(lit, "formerly", errors) else {
            ok = false;
            continue;
        };
        if current == Some(name.as_str()) {
            errors.spanned(
                lit,
                format!(
                    "`{name}` is the current `{key}`: `formerly` lists the names it had before"
                ),
            );
            ok = false;
        } else if out.contains(&name) {
            errors.spanned(lit, format!("`{name}` is listed twice in `formerly`"));
            ok = false;
        } else {
            out.push(name);
        }
    }
    ok.then_some(out)
}

/// Records an unknown key and skips its value.
pub(crate) fn unknown_key(
    meta: &ParseNestedMeta<'_>,
    what: &str,
    expected: &str,
    errors: &mut Errors,
) -> syn::Result<()> {
    errors.spanned(
        &meta.path,
        format!(
            "unknown {what} `{}`: expected {expected}",
            key_name(&meta.path)
        ),
    );
    skip_value(meta)
}

/// A name stored in the database (an event type, an aggregate type, a subscriber): not empty, no
/// whitespace or control characters.
pub(crate) fn check_name(lit: &LitStr, key: &str, errors: &mut Errors) -> Option<String> {
    let value = lit.value();
    if value.is_empty() {
        errors.spanned(lit, format!("`{key}` must not be empty"));
        None
    } else if value.chars().any(|c| c.is_whitespace() || c.is_control()) {
        errors.spanned(
            lit,
            format!("`{key}` must not contain whitespace or control characters"),
        );
        None
    } else {
        Some(value)
    }
}

/// The path of the runtime crate: the given one, or `::outbox_core`.
pub(crate) fn krate_or_default(krate: Option<&Path>) -> Path {
    krate
        .cloned()
        .unwrap_or_else(|| parse_quote!(::outbox_core))
}

/// Records an error on each type listed a second time; `true` when there is none.
pub(crate) fn reject_duplicate_types(
    types: &[Type],
    what: &str,
    list: &str,
    errors: &mut Errors,
) -> bool {
    let mut seen: Vec<String> = Vec::new();
    let mut ok = true;
    for ty in types {
        let text = crate::subscriber::type_text(ty);
        if seen.contains(&text) {
            errors.spanned(ty, format!("{what} `{text}` is listed twice in {list}"));
            ok = false;
        } else {
            seen.push(text);
        }
    }
    ok
}
