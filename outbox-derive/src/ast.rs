//! The input item as the derive sees it: a struct with named fields and its outbox attributes.

use syn::{Data, DeriveInput, Fields, Ident, Type};

use crate::attr::{self, ContainerAttrs, FieldAttrs};
use crate::ctxt::Errors;

/// A `#[derive(OutboxEvent)]` input.
pub(crate) struct Event<'a> {
    pub(crate) input: &'a DeriveInput,
    pub(crate) attrs: ContainerAttrs,
    /// The named fields; `None` when the item is not a struct with named fields (error recorded).
    pub(crate) fields: Option<Vec<Field<'a>>>,
}

/// One named field.
pub(crate) struct Field<'a> {
    pub(crate) ident: &'a Ident,
    pub(crate) ty: &'a Type,
    pub(crate) attrs: FieldAttrs,
}

pub(crate) fn parse<'a>(input: &'a DeriveInput, errors: &mut Errors) -> Event<'a> {
    let attrs = attr::container(&input.attrs, errors);
    let fields = match &input.data {
        Data::Struct(data) => match &data.fields {
            Fields::Named(named) => Some(
                named
                    .named
                    .iter()
                    .filter_map(|field| {
                        Some(Field {
                            ident: field.ident.as_ref()?,
                            ty: &field.ty,
                            attrs: attr::field(&field.attrs, errors),
                        })
                    })
                    .collect(),
            ),
            Fields::Unnamed(fields) => {
                errors.spanned(
                    fields,
                    "`#[derive(OutboxEvent)]` needs named fields: the payload's `data` is a JSON \
                     object, so write `struct Name { field: Type }`",
                );
                None
            }
            Fields::Unit => {
                errors.spanned(
                    &input.ident,
                    "`#[derive(OutboxEvent)]` needs named fields, and at least the aggregate id: \
                     write `struct Name { #[outbox(aggregate_id)] id: Uuid }`",
                );
                None
            }
        },
        Data::Enum(data) => {
            errors.spanned(
                data.enum_token,
                "`#[derive(OutboxEvent)]` works on structs, not enums: make each variant its own \
                 event struct",
            );
            None
        }
        Data::Union(data) => {
            errors.spanned(
                data.union_token,
                "`#[derive(OutboxEvent)]` works on structs, not unions",
            );
            None
        }
    };
    Event {
        input,
        attrs,
        fields,
    }
}
