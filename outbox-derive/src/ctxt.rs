//! Collects every error a macro finds, so that one build reports all of them.

use std::fmt::Display;

use quote::ToTokens;

/// Errors found so far; [`Errors::finish`] combines them into one `syn::Error`.
#[derive(Default)]
pub(crate) struct Errors {
    first: Option<syn::Error>,
}

impl Errors {
    /// Records an error.
    pub(crate) fn push(&mut self, error: syn::Error) {
        match &mut self.first {
            Some(first) => first.combine(error),
            None => self.first = Some(error),
        }
    }

    /// Records an error spanning `tokens`.
    pub(crate) fn spanned(&mut self, tokens: impl ToTokens, message: impl Display) {
        self.push(syn::Error::new_spanned(tokens, message));
    }

    /// `Ok` when nothing was recorded, else every recorded error.
    pub(crate) fn finish(self) -> Result<(), syn::Error> {
        self.first.map_or(Ok(()), Err)
    }
}
