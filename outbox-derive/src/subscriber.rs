//! `#[subscriber(events = [...])]`: parse, check, expand.

use proc_macro2::{Span, TokenStream};
use quote::{ToTokens, quote, quote_spanned};
use syn::parse::Parser;
use syn::spanned::Spanned;

use syn::{DeriveInput, Ident, LitStr, Path, Type};

use crate::attr::{self, Seen};
use crate::ctxt::Errors;

/// The arguments of `#[subscriber(...)]`.
#[derive(Default)]
struct Args {
    /// Whether `events` was given at all (its value may still be invalid, with its own error).
    events_given: bool,
    events: Option<(Span, Vec<Type>)>,
    name: Option<LitStr>,
    formerly: Option<Vec<LitStr>>,
    krate: Option<Path>,
}

/// A checked subscriber: its stored name, earlier names and events.
struct Checked<'a> {
    name: String,
    formerly: Vec<String>,
    events: &'a [Type],
}

pub(crate) fn expand(args: TokenStream, item: &TokenStream) -> TokenStream {
    let mut errors = Errors::default();
    let Ok(input) = syn::parse2::<DeriveInput>(item.clone()) else {
        let error = syn::Error::new_spanned(
            item,
            "`#[subscriber]` goes on a struct or an enum: the type whose `Handle` impls \
             handle the events",
        );
        let error = error.into_compile_error();
        return quote!(#error #item);
    };
    let args = parse_args(args, &mut errors);
    let krate = attr::krate_or_default(args.krate.as_ref());
    let checked = check(&input, &args, &mut errors);
    let generated = match (errors.finish(), checked) {
        (Ok(()), Some(checked)) => subscriber_impl(&input, &krate, &checked),
        (result, _) => {
            let errors = result.err().map(syn::Error::into_compile_error);
            let stub = stub_impl(&input, &krate);
            quote!(#errors #stub)
        }
    };
    quote!(#input #generated)
}

fn parse_args(args: TokenStream, errors: &mut Errors) -> Args {
    let mut out = Args::default();
    let mut seen = Seen::new("subscriber attribute");
    let parser = syn::meta::parser(|meta| {
        let key = &meta.path;
        if key.is_ident("events") {
            let value = attr::type_list(&meta, "events = [PaymentSucceeded, BotKicked]", errors)?;
            if seen.first(key, errors) {
                out.events_given = true;
                out.events = value;
            }
        } else if key.is_ident("name") {
            let value = attr::string_value(&meta, "name = \"licensing\"", errors)?;
            if seen.first(key, errors) {
                out.name = value;
            }
        } else if key.is_ident("formerly") {
            let value = attr::string_list(&meta, "formerly = [\"billing\"]", errors)?;
            if seen.first(key, errors) {
                out.formerly = value;
            }
        } else if key.is_ident("crate") {
            let value = attr::path_value(&meta, "crate = \"my_app::outbox_core\"", errors)?;
            if seen.first(key, errors) {
                out.krate = value;
            }
        } else {
            attr::unknown_key(
                &meta,
                "subscriber attribute",
                "`events`, `name`, `formerly` or `crate`",
                errors,
            )?;
        }
        Ok(())
    });
    if let Err(error) = parser.parse2(args) {
        errors.push(error);
    }
    out
}

/// The subscriber's names and events, if every check passed.
fn check<'a>(input: &DeriveInput, args: &'a Args, errors: &mut Errors) -> Option<Checked<'a>> {
    if matches!(input.data, syn::Data::Union(_)) {
        errors.spanned(
            &input.ident,
            "`#[subscriber]` goes on a struct or an enum, not a union",
        );
    }
    let name = match &args.name {
        Some(lit) => attr::check_name(lit, "name", errors),
        None => Some(snake_case(&input.ident)),
    };
    let formerly = match &args.formerly {
        Some(names) => attr::check_formerly(names, name.as_deref(), "name", errors),
        None => Some(Vec::new()),
    };
    let events = match &args.events {
        None if args.events_given => None,
        None => {
            errors.push(syn::Error::new(
                Span::call_site(),
                "`#[subscriber]` needs the events it takes: `#[subscriber(events = [PaymentSucceeded, ...])]`",
            ));
            None
        }
        Some((span, events)) if events.is_empty() => {
            errors.push(syn::Error::new(
                *span,
                "a subscriber takes at least one event: list them in `events = [...]`",
            ));
            None
        }
        Some((_, events)) => attr::reject_duplicate_types(events, "event", "`events`", errors)
            .then_some(events.as_slice()),
    };
    Some(Checked {
        name: name?,
        formerly: formerly?,
        events: events?,
    })
}

fn subscriber_impl(input: &DeriveInput, krate: &Path, checked: &Checked<'_>) -> TokenStream {
    let Checked {
        name,
        formerly,
        events,
    } = checked;
    let private = quote!(#krate::__private);
    let ident = &input.ident;
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    let event_types = events
        .iter()
        .map(|event| quote_spanned!(event.span()=> <#event as #private::OutboxEvent>::EVENT_TYPE));
    // The locals keep the call site's hygiene (an event type may come from another macro's
    // expansion); the call is located at the event, where an unmet `Handle` bound is reported.
    let locals = quote!(self, event, delivery);
    let dispatch = events.iter().map(|event| {
        let handle = quote_spanned! {event.span()=>
            <Self as #private::Handle<#event>>::handle(#locals)
        };
        quote! {
            if let ::core::option::Option::Some(event) = event.downcast_ref::<#event>() {
                return #private::Box::pin(#handle);
            }
        }
    });
    let subscribed_in = subscribed_in_impl(input, &private, events);
    quote! {
        #[doc(hidden)]
        #[allow(unused_qualifications, clippy::all)]
        const _: () = {
            #[automatically_derived]
            impl #impl_generics #private::Subscriber for #ident #ty_generics #where_clause {
                const NAME: &'static str = #name;
                const FORMERLY: &'static [&'static str] = &[#(#formerly),*];
                const EVENTS: &'static [&'static str] = &[#(#event_types),*];

                fn deliver<'a>(
                    &'a self,
                    event: &'a #private::Decoded,
                    delivery: &'a #private::Delivery<'a>,
                ) -> #private::DeliverFuture<'a> {
                    #(#dispatch)*
                    #private::not_taken(<Self as #private::Subscriber>::NAME, delivery)
                }
            }

            #subscribed_in
        };
    }
}

/// `impl<R: Routes<A> + Routes<B>> SubscribedIn<R> for S {}`: the subscriber fits a router iff
/// the router routes each of its events.
fn subscribed_in_impl(input: &DeriveInput, private: &TokenStream, events: &[Type]) -> TokenStream {
    let ident = &input.ident;
    let mut generics = input.generics.clone();
    let router = Ident::new("__OutboxRouter", Span::mixed_site());
    generics.params.push(syn::parse_quote!(#router));
    let (impl_generics, _, _) = generics.split_for_impl();
    let (_, ty_generics, where_clause) = input.generics.split_for_impl();
    let bounds = events
        .iter()
        .map(|event| quote_spanned!(event.span()=> #router: #private::Routes<#event>));
    let where_clause = match where_clause {
        Some(clause) => {
            let predicates = &clause.predicates;
            quote!(where #predicates, #(#bounds),*)
        }
        None => quote!(where #(#bounds),*),
    };
    quote! {
        #[automatically_derived]
        impl #impl_generics #private::SubscribedIn<#router> for #ident #ty_generics #where_clause {}
    }
}

/// Impls that compile beside the errors, so that one mistake gives one error.
fn stub_impl(input: &DeriveInput, krate: &Path) -> TokenStream {
    if matches!(input.data, syn::Data::Union(_)) {
        return TokenStream::new();
    }
    let private = quote!(#krate::__private);
    let ident = &input.ident;
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    let subscribed_in = subscribed_in_impl(input, &private, &[]);
    quote! {
        const _: () = {
            impl #impl_generics #private::Subscriber for #ident #ty_generics #where_clause {
                const NAME: &'static str = "";
                const EVENTS: &'static [&'static str] = &[];

                fn deliver<'a>(
                    &'a self,
                    _: &'a #private::Decoded,
                    delivery: &'a #private::Delivery<'a>,
                ) -> #private::DeliverFuture<'a> {
                    #private::not_taken("", delivery)
                }
            }

            #subscribed_in
        };
    }
}

/// `Licensing` -> `licensing`, `HttpNotifier` -> `http_notifier`, `SMSGateway` -> `sms_gateway`.
pub(crate) fn snake_case(ident: &Ident) -> String {
    let name = syn::ext::IdentExt::unraw(ident).to_string();
    let chars: Vec<char> = name.chars().collect();
    let mut out = String::with_capacity(name.len() + 4);
    for (i, &c) in chars.iter().enumerate() {
        if c.is_uppercase() {
            let prev = i.checked_sub(1).map(|p| chars[p]);
            let next = chars.get(i + 1).copied();
            let starts_word = prev.is_some_and(|p| p.is_lowercase() || p.is_ascii_digit())
                || (prev.is_some_and(char::is_uppercase) && next.is_some_and(char::is_lowercase));
            if starts_word && !out.ends_with('_') {
                out.push('_');
            }
            out.extend(c.to_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

/// The token text of a type, for messages and duplicate checks.
pub(crate) fn type_text(ty: &Type) -> String {
    ty.to_token_stream().to_string().replace(' ', "")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_default_to_snake_case() {
        for (ident, name) in [
            ("Licensing", "licensing"),
            ("HttpNotifier", "http_notifier"),
            ("SMSGateway", "sms_gateway"),
            ("Audit2Log", "audit2_log"),
            ("r#Move", "move"),
            ("already_snake", "already_snake"),
        ] {
            let ident: Ident = syn::parse_str(ident).unwrap();
            assert_eq!(snake_case(&ident), name);
        }
    }
}
