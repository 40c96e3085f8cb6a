//! `#[router(events = [...])]`: parse, check, expand.
//!
//! Checks that need the subscribers' own event lists, which another macro expansion holds, are
//! emitted as compile-time evaluated code: trait bounds (`SubscribedIn`, `Routes`) and constant
//! assertions whose panic message is the error the user reads.

use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned};
use syn::parse::Parser;
use syn::spanned::Spanned;
use syn::{Data, DeriveInput, Fields, Ident, Path, Type};

use crate::attr::{self, Seen};
use crate::ctxt::Errors;
use crate::subscriber::type_text;

#[derive(Default)]
struct Args {
    /// Whether `events` was given at all (its value may still be invalid, with its own error).
    events_given: bool,
    events: Option<(Span, Vec<Type>)>,
    /// `database = sqlx::Postgres`: the one database the application runs on.
    database: Option<Type>,
    krate: Option<Path>,
}

/// A field of the router: a subscriber, or an observer.
struct Member {
    field: Ident,
    ty: Type,
    observer: bool,
}

pub(crate) fn expand(args: TokenStream, item: &TokenStream) -> TokenStream {
    let mut errors = Errors::default();
    let Ok(mut input) = syn::parse2::<DeriveInput>(item.clone()) else {
        let error = syn::Error::new_spanned(
            item,
            "`#[router]` goes on a struct whose fields are the subscribers",
        )
        .into_compile_error();
        return quote!(#error #item);
    };
    let args = parse_args(args, &mut errors);
    let krate = attr::krate_or_default(args.krate.as_ref());
    let members = members(&mut input, &mut errors);
    let events = check_events(&args, &mut errors);
    if !input.generics.params.is_empty() {
        errors.spanned(
            &input.generics,
            "a router cannot be generic: it is the application's one routing table",
        );
    }
    let generated = match (errors.finish(), members, events) {
        (Ok(()), Some(members), Some(events)) => {
            router_impl(&input, &krate, &members, events, args.database.as_ref())
        }
        (result, _, _) => result
            .err()
            .map(syn::Error::into_compile_error)
            .unwrap_or_default(),
    };
    quote!(#input #generated)
}

fn parse_args(args: TokenStream, errors: &mut Errors) -> Args {
    let mut out = Args::default();
    let mut seen = Seen::new("router attribute");
    let parser = syn::meta::parser(|meta| {
        let key = &meta.path;
        if key.is_ident("events") {
            let value = attr::type_list(&meta, "events = [PaymentSucceeded, BotKicked]", errors)?;
            if seen.first(key, errors) {
                out.events_given = true;
                out.events = value;
            }
        } else if key.is_ident("database") {
            let value: Type = meta.value()?.parse().map_err(|error| {
                syn::Error::new(
                    error.span(),
                    "expected a database type: `database = sqlx::Postgres`",
                )
            })?;
            if seen.first(key, errors) {
                out.database = Some(value);
            }
        } else if key.is_ident("crate") {
            let value = attr::path_value(&meta, "crate = \"my_app::outbox_core\"", errors)?;
            if seen.first(key, errors) {
                out.krate = value;
            }
        } else {
            attr::unknown_key(
                &meta,
                "router attribute",
                "`events`, `database` or `crate`",
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

fn check_events<'a>(args: &'a Args, errors: &mut Errors) -> Option<&'a [Type]> {
    match &args.events {
        None if args.events_given => None,
        None => {
            errors.push(syn::Error::new(
                Span::call_site(),
                "`#[router]` needs its event catalog: `#[router(events = [PaymentSucceeded, ...])]`",
            ));
            None
        }
        Some((span, events)) if events.is_empty() => {
            errors.push(syn::Error::new(
                *span,
                "the event catalog is empty: list the events this application publishes in \
                 `events = [...]`",
            ));
            None
        }
        Some((_, events)) => attr::reject_duplicate_types(events, "event", "the catalog", errors)
            .then_some(events.as_slice()),
    }
}

/// The fields, with `#[observer]` removed from the item (it is not a real attribute).
fn members(input: &mut DeriveInput, errors: &mut Errors) -> Option<Vec<Member>> {
    let fields = match &mut input.data {
        Data::Struct(data) => match &mut data.fields {
            Fields::Named(named) => &mut named.named,
            other => {
                errors.spanned(
                    &*other,
                    "a router's subscribers are named fields: `struct App { licensing: Licensing }`",
                );
                return None;
            }
        },
        Data::Enum(data) => {
            errors.spanned(
                data.enum_token,
                "`#[router]` goes on a struct whose fields are the subscribers",
            );
            return None;
        }
        Data::Union(data) => {
            errors.spanned(
                data.union_token,
                "`#[router]` goes on a struct whose fields are the subscribers",
            );
            return None;
        }
    };
    let mut members = Vec::new();
    let mut seen_types: Vec<(String, Ident)> = Vec::new();
    for field in fields.iter_mut() {
        let mut observer = false;
        let mut ok = true;
        field.attrs.retain(|attr| {
            if !attr.path().is_ident("observer") {
                return true;
            }
            if !matches!(attr.meta, syn::Meta::Path(_)) {
                errors.spanned(attr, "`#[observer]` takes no arguments");
                ok = false;
            } else if observer {
                errors.spanned(attr, "duplicate `#[observer]`");
                ok = false;
            }
            observer = true;
            false
        });
        let Some(ident) = field.ident.clone() else {
            continue;
        };
        let text = type_text(&field.ty);
        if let Some((_, first)) = seen_types.iter().find(|(seen, _)| *seen == text) {
            errors.spanned(
                &field.ty,
                format!(
                    "`{text}` is already in this router, as field `{first}`: each subscriber \
                     appears once"
                ),
            );
            ok = false;
        } else {
            seen_types.push((text, ident.clone()));
        }
        if ok {
            members.push(Member {
                field: ident,
                ty: field.ty.clone(),
                observer,
            });
        }
    }
    Some(members)
}

fn router_impl(
    input: &DeriveInput,
    krate: &Path,
    members: &[Member],
    events: &[Type],
    database: Option<&Type>,
) -> TokenStream {
    let private = quote!(#krate::__private);
    let router = &input.ident;
    let router_name = router.to_string();

    // One constant per catalog event and per member: the only places where the event must be an
    // `OutboxEvent` and the member a subscriber (of this router) or an observer. Everything else
    // reads these constants, so one mistake is one error.
    let event_consts: Vec<Ident> = (0..events.len())
        .map(|i| Ident::new(&format!("__EVENT_{i}"), Span::mixed_site()))
        .collect();
    let member_consts: Vec<Ident> = members
        .iter()
        .map(|m| Ident::new(&format!("__MEMBER_{}", m.field), Span::mixed_site()))
        .collect();
    let event_infos = events.iter().zip(&event_consts).map(|(event, name)| {
        let info = at(event, quote!(#private::EventInfo::of::<#event>()));
        quote!(const #name: #private::EventInfo = #info;)
    });
    let member_infos = members.iter().zip(&member_consts).map(|(member, name)| {
        let ty = &member.ty;
        let info = if member.observer {
            at(ty, quote!(#private::MemberInfo::<#ty>::observer()))
        } else {
            at(
                ty,
                quote!(#private::MemberInfo::<#ty>::subscriber_in::<#router>()),
            )
        };
        quote!(const #name: #private::MemberInfo<#ty> = #info;)
    });

    // Every catalog event is taken by at least one subscriber (observers do not count).
    let routed_checks = events.iter().zip(&event_consts).map(|(event, info)| {
        let message = format!(
            "event `{}` is in the catalog of router `{router_name}` but no subscriber takes it: \
             add it to a subscriber's `#[subscriber(events = [...])]`, or remove it from the \
             catalog (observers do not count)",
            type_text(event)
        );
        quote_spanned! {event.span()=>
            const _: () = if !#private::routed(&__MEMBERS, #info.event_type) {
                ::core::panic!(#message)
            };
        }
    });

    // No two catalog events share an event type name, and no two members share a name.
    let mut unique_checks = Vec::new();
    for (i, a) in events.iter().enumerate() {
        for (j, b) in events.iter().enumerate().skip(i + 1) {
            let message = format!(
                "events `{}` and `{}` of router `{router_name}` have the same event type name: \
                 the relay could not tell them apart; give one of them another \
                 `#[outbox(event_type = \"...\")]`",
                type_text(a),
                type_text(b)
            );
            let (a_info, b_info) = (&event_consts[i], &event_consts[j]);
            let renamed = format!(
                "events `{}` and `{}` of router `{router_name}` share a durable name: the event \
                 type or a `formerly` name of one is a `formerly` name of the other, so stored \
                 events of that name could be either; keep the name in the `formerly` of the one \
                 type whose events were stored under it, and remove it from the other",
                type_text(a),
                type_text(b)
            );
            unique_checks.push(quote_spanned! {b.span()=>
                const _: () = if #private::str_eq(#a_info.event_type, #b_info.event_type) {
                    ::core::panic!(#message)
                } else if #private::names_overlap(
                    #a_info.event_type, #a_info.formerly, #b_info.event_type, #b_info.formerly,
                ) {
                    ::core::panic!(#renamed)
                };
            });
        }
    }
    for (i, a) in members.iter().enumerate() {
        for (j, b) in members.iter().enumerate().skip(i + 1) {
            let message = format!(
                "fields `{}` and `{}` of router `{router_name}` have the same subscriber name: \
                 their delivery state would mix; give one of them another \
                 `#[subscriber(name = \"...\")]`",
                a.field, b.field
            );
            let renamed = format!(
                "fields `{}` and `{}` of router `{router_name}` share a durable name: the name \
                 or a `formerly` name of one is a `formerly` name of the other, so the \
                 deliveries stored under it would mix; rename the subscriber to a name no other \
                 subscriber has or had",
                a.field, b.field
            );
            let (a_info, b_info) = (&member_consts[i], &member_consts[j]);
            unique_checks.push(quote_spanned! {b.ty.span()=>
                const _: () = if #private::str_eq(#a_info.name, #b_info.name) {
                    ::core::panic!(#message)
                } else if #private::names_overlap(
                    #a_info.name, #a_info.formerly, #b_info.name, #b_info.formerly,
                ) {
                    ::core::panic!(#renamed)
                };
            });
        }
    }

    let routes = events.iter().map(|event| {
        quote_spanned! {event.span()=>
            #[automatically_derived]
            impl #private::Routes<#event> for #router {}
        }
    });
    // The databases it runs on: the one named, or any.
    let runs_on = match database {
        Some(database) => quote_spanned! {database.span()=>
            #[automatically_derived]
            impl #private::RunsOn<#database> for #router {}
        },
        None => {
            let db = Ident::new("__OutboxDatabase", Span::mixed_site());
            quote! {
                #[automatically_derived]
                impl<#db> #private::RunsOn<#db> for #router {}
            }
        }
    };
    let member_count = members.len();
    let event_count = events.len();
    let fields = members.iter().map(|m| &m.field);
    let schema_fns = events.iter().map(|event| {
        quote_spanned! {event.span()=>
            (&&#private::SchemaProbe::<#event>::new()).schema_fn()
        }
    });

    quote! {
        #[doc(hidden)]
        #[allow(unused_qualifications, non_upper_case_globals, clippy::all)]
        const _: () = {
            #(#event_infos)*
            #(#member_infos)*
            const __EVENTS: [#private::EventInfo; #event_count] = [#(#event_consts),*];
            const __MEMBERS: [#private::Member; #member_count] = [#(#member_consts.member()),*];

            #(#routed_checks)*
            #(#unique_checks)*
            #(#routes)*
            #runs_on

            #[automatically_derived]
            impl #private::Router for #router {
                fn subscribers(&self, event_type: &str) -> ::core::option::Option<&[&'static str]> {
                    static TABLE: #private::LazyLock<#private::RouteTable> =
                        #private::LazyLock::new(|| {
                            #private::RouteTable::new(&__EVENTS, &__MEMBERS)
                        });
                    TABLE.get(event_type)
                }

                fn decode(
                    &self,
                    event: &#private::StoredEvent,
                ) -> ::core::result::Result<#private::Decoded, #private::DecodeError> {
                    match __EVENTS.iter().find(|info| info.is_named(&event.event_type)) {
                        ::core::option::Option::Some(info) => (info.decode)(event),
                        ::core::option::Option::None => {
                            ::core::result::Result::Err(#private::unknown_event_type(event))
                        }
                    }
                }

                fn current_subscriber(
                    &self,
                    stored: &str,
                ) -> ::core::option::Option<&'static str> {
                    #(
                        if #member_consts.is_named(stored) {
                            return ::core::option::Option::Some(#member_consts.name);
                        }
                    )*
                    ::core::option::Option::None
                }

                fn catalog() -> #private::Catalog {
                    #[allow(unused_imports)]
                    use #private::{HasSchema as _, NoSchema as _};
                    let schemas: [::core::option::Option<#private::SchemaFn>; #event_count] =
                        [#(#schema_fns),*];
                    let events = __EVENTS
                        .iter()
                        .zip(schemas)
                        .map(|(info, schema)| {
                            (info.entry)(
                                schema,
                                #private::RouteTable::members_of(info.event_type, &__MEMBERS),
                            )
                        })
                        .collect();
                    #private::Catalog::new(
                        #router_name,
                        events,
                        #private::Vec::from([#(#member_consts.entry()),*]),
                    )
                }

                fn deliver<'a>(
                    &'a self,
                    subscriber: &'a str,
                    event: &'a #private::Decoded,
                    delivery: &'a #private::Delivery<'a>,
                ) -> impl ::core::future::Future<
                    Output = ::core::result::Result<(), #private::HandlerError>,
                > + ::core::marker::Send + 'a {
                    #(
                        if #member_consts.is_named(subscriber) {
                            return (#member_consts.deliver)(&self.#fields, event, delivery);
                        }
                    )*
                    let _ = event;
                    #private::unknown_subscriber(subscriber)
                }
            }
        };
    }
}

/// `tokens`, every one of them located at `anchor` (resolved as written), so that an unmet bound
/// in them is reported on the user's token rather than on the attribute.
fn at(anchor: &impl Spanned, tokens: TokenStream) -> TokenStream {
    let span = Span::call_site().located_at(anchor.span());
    tokens
        .into_iter()
        .map(|mut tree| {
            if let proc_macro2::TokenTree::Group(group) = &tree {
                let mut inner =
                    proc_macro2::Group::new(group.delimiter(), at(anchor, group.stream()));
                inner.set_span(span);
                tree = proc_macro2::TokenTree::Group(inner);
            } else {
                tree.set_span(span);
            }
            tree
        })
        .collect()
}
