//! Procedural macros for **outbox**. Use them through `outbox-core`, which re-exports them and
//! documents them: the code they generate names only `outbox_core::__private` paths.
//!
//! The crate is laid out in stages: `attr.rs` parses `#[outbox(...)]` attributes, `ast.rs` reads
//! the input item, `valid.rs` checks what the attributes say, and `expand.rs` writes the impl.
//! Errors are collected in `ctxt.rs` so that one build reports every mistake, each on its own token.

mod ast;
mod attr;
mod ctxt;
mod expand;
mod valid;

use proc_macro::TokenStream;
use syn::{DeriveInput, parse_macro_input};

/// Derives `outbox_core::OutboxEvent`; documented there.
#[proc_macro_derive(OutboxEvent, attributes(outbox))]
pub fn derive_outbox_event(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    expand::derive_outbox_event(&input).into()
}
