//! Procedural macros for **outbox**. Use them through `outbox-core`, which re-exports them and
//! documents them: the code they generate names only `outbox_core::__private` paths.
//!
//! `#[derive(OutboxEvent)]` is laid out in stages: `attr.rs` parses `#[outbox(...)]` attributes,
//! `ast.rs` reads the input item, `valid.rs` checks what the attributes say, and `expand.rs`
//! writes the impl. `subscriber.rs` and `router.rs` hold the two attribute macros, each as
//! parse, check and expand functions over the helpers of `attr.rs`. Errors are collected in
//! `ctxt.rs` so that one build reports every mistake, each on its own token.

mod ast;
mod attr;
mod ctxt;
mod expand;
mod router;
mod subscriber;
mod valid;

use proc_macro::TokenStream;
use syn::{DeriveInput, parse_macro_input};

/// Derives `outbox_core::OutboxEvent`; documented there.
#[proc_macro_derive(OutboxEvent, attributes(outbox))]
pub fn derive_outbox_event(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    expand::derive_outbox_event(&input).into()
}

/// Declares a subscriber; documented in `outbox_core`.
#[proc_macro_attribute]
pub fn subscriber(args: TokenStream, item: TokenStream) -> TokenStream {
    subscriber::expand(args.into(), &item.into()).into()
}

/// Declares the application's router; documented in `outbox_core`.
#[proc_macro_attribute]
pub fn router(args: TokenStream, item: TokenStream) -> TokenStream {
    router::expand(args.into(), &item.into()).into()
}
