//! Writes the `OutboxEvent` impl, or a stub impl beside the errors so that one mistake gives one
//! error.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;

use syn::{Data, DeriveInput, Path};

use crate::ctxt::Errors;
use crate::{ast, valid};

pub(crate) fn derive_outbox_event(input: &DeriveInput) -> TokenStream {
    let mut errors = Errors::default();
    let event = ast::parse(input, &mut errors);
    let checked = valid::check(&event, &mut errors);
    match (errors.finish(), checked) {
        (Ok(()), Some(checked)) => event_impl(input, &checked),
        (result, _) => {
            let errors = result.err().map(syn::Error::into_compile_error);
            // A union cannot be serialized, so a stub impl would only add errors.
            let stub = (!matches!(input.data, Data::Union(_)))
                .then(|| stub_impl(input, &valid::krate(&event)));
            quote!(#errors #stub)
        }
    }
}

fn event_impl(input: &DeriveInput, checked: &valid::Checked<'_>) -> TokenStream {
    let valid::Checked {
        krate,
        aggregate_type,
        event_type,
        formerly,
        version,
        upcasts,
        aggregate_id,
        occurred_at,
    } = checked;
    let private = quote!(#krate::__private);
    let upcasters = upcasts.iter().map(|(from, with)| {
        quote_spanned! {with.span()=>
            #private::Upcaster::new(#from, |data| #private::upcast_with(#with, data))
        }
    });
    // `self` keeps the call site's hygiene (a field type may come from another macro's
    // expansion); the call is located at the type, where an unmet bound is reported.
    let this = quote!(self);
    let (id_field, id_ty) = aggregate_id;
    let aggregate_id = quote_spanned! {id_ty.span()=>
        <#id_ty as #private::AggregateId>::to_uuid(&#this.#id_field)
    };
    let occurred_at = occurred_at.map(|(field, ty)| {
        let value = quote_spanned! {ty.span()=>
            <#ty as #private::Timestamp>::to_offset_date_time(&#this.#field)
        };
        quote! {
            fn occurred_at(&self) -> ::core::option::Option<#private::OffsetDateTime> {
                #value
            }
        }
    });
    let body = quote! {
        const AGGREGATE_TYPE: &'static str = #aggregate_type;
        const EVENT_TYPE: &'static str = #event_type;
        const FORMERLY: &'static [&'static str] = &[#(#formerly),*];
        const VERSION: u32 = #version;
        const UPCASTERS: &'static [#private::Upcaster] = &[#(#upcasters),*];

        fn aggregate_id(&self) -> #private::Uuid {
            #aggregate_id
        }

        #occurred_at
    };
    wrap(input, krate, &body)
}

/// An impl that compiles whatever the attributes said, emitted beside their errors.
fn stub_impl(input: &DeriveInput, krate: &Path) -> TokenStream {
    let body = quote! {
        const AGGREGATE_TYPE: &'static str = "";
        const EVENT_TYPE: &'static str = "";
        const VERSION: u32 = 1;

        fn aggregate_id(&self) -> #krate::__private::Uuid {
            ::core::unreachable!()
        }
    };
    wrap(input, krate, &body)
}

fn wrap(input: &DeriveInput, krate: &Path, body: &TokenStream) -> TokenStream {
    let ident = &input.ident;
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    // The trait path carries the struct name's span, so that an unmet supertrait bound (a missing
    // `Serialize`, say) is reported on the struct.
    let trait_path = quote_spanned!(ident.span()=> #krate::__private::OutboxEvent);
    quote! {
        #[doc(hidden)]
        #[allow(non_upper_case_globals, unused_qualifications, clippy::all)]
        const _: () = {
            #[automatically_derived]
            impl #impl_generics #trait_path for #ident #ty_generics #where_clause {
                #body
            }
        };
    }
}

#[cfg(test)]
mod tests {
    use super::derive_outbox_event;

    fn expand(input: &str) -> String {
        derive_outbox_event(&syn::parse_str(input).unwrap()).to_string()
    }

    #[test]
    fn generated_code_names_only_the_private_module_of_the_runtime_crate() {
        let out = expand(
            "#[outbox(aggregate_type = \"bot\", version = 2, upcast(from = 1, with = up))]
             struct BotInstalled { #[outbox(aggregate_id)] bot_id: Uuid }",
        );
        assert!(
            out.contains(":: outbox_core :: __private :: OutboxEvent"),
            "{out}"
        );
        let outside_private = out
            .match_indices("outbox_core ::")
            .filter(|(at, _)| !out[*at..].starts_with("outbox_core :: __private ::"))
            .count();
        assert_eq!(outside_private, 0, "{out}");
    }

    #[test]
    fn crate_attribute_replaces_every_runtime_path() {
        let out = expand(
            "#[outbox(crate = \"my_app::events\", aggregate_type = \"bot\", version = 2)]
             #[outbox(upcast(from = 1, with = up))]
             struct BotInstalled {
                 #[outbox(aggregate_id)] bot_id: Uuid,
                 #[outbox(occurred_at)] at: OffsetDateTime,
             }",
        );
        assert!(!out.contains("outbox_core"), "{out}");
        assert!(
            out.contains("my_app :: events :: __private :: AggregateId"),
            "{out}"
        );
        assert!(
            out.contains("my_app :: events :: __private :: Timestamp"),
            "{out}"
        );
        assert!(
            out.contains("my_app :: events :: __private :: Upcaster"),
            "{out}"
        );
    }

    #[test]
    fn errors_come_with_a_stub_impl_for_structs_and_none_for_unions() {
        let out = expand("#[outbox(version = 0)] struct BotInstalled { bot_id: Uuid }");
        assert!(out.contains("compile_error"), "{out}");
        assert!(out.contains("impl :: outbox_core :: __private :: OutboxEvent for BotInstalled"));
        let out = expand("#[outbox(aggregate_type = \"bot\")] union Bits { a: u8 }");
        assert!(out.contains("compile_error"), "{out}");
        assert!(!out.contains("impl"), "{out}");
    }
}
