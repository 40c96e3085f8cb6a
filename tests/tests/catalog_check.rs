//! The compatibility check of the test kit, on a fixture application in several revisions (one
//! module each, as its code would be at successive commits): what breaks stored events fails,
//! with a message that says what to do; the proper version bump with an upcaster passes.

use outbox_core::testing::{bless_catalog, check_catalog, compare_catalog};
use outbox_core::{Catalog, Router};
use serde_json::Value;

/// The fixture's revisions. Each has the same router name and subscriber, like one
/// application's code over time.
macro_rules! revision {
    ($name:ident, events = [$($event:ident),*], subscriber = $sub:literal $(, formerly = [$($old:literal),*])?, { $($items:item)* }) => {
        mod $name {
            #![allow(dead_code)]
            use outbox_core::{Delivery, Handle, HandlerError, OutboxEvent, router, subscriber};
            #[allow(unused_imports)]
            use schemars::JsonSchema;
            use serde::{Deserialize, Serialize};
            use serde_json::Value;
            use uuid::Uuid;

            $($items)*

            #[subscriber(events = [$($event),*], name = $sub $(, formerly = [$($old),*])?)]
            pub(crate) struct Billing;

            impl<E: OutboxEvent> Handle<E> for Billing {
                async fn handle(&self, _: &E, _: &Delivery<'_>) -> Result<(), HandlerError> {
                    Ok(())
                }
            }

            #[router(events = [$($event),*])]
            pub(crate) struct App {
                billing: Billing,
            }

            pub(crate) fn unused(_: Value, _: Uuid) {}
        }
    };
}

revision!(
    first,
    events = [PlanChanged, PlanCancelled],
    subscriber = "billing",
    {
        #[derive(Serialize, Deserialize, JsonSchema, OutboxEvent)]
        #[outbox(aggregate_type = "plan")]
        pub(crate) struct PlanChanged {
            #[outbox(aggregate_id)]
            pub(crate) plan_id: Uuid,
            pub(crate) tier: String,
        }

        #[derive(Serialize, Deserialize, JsonSchema, OutboxEvent)]
        #[outbox(aggregate_type = "plan")]
        pub(crate) struct PlanCancelled {
            #[outbox(aggregate_id)]
            pub(crate) plan_id: Uuid,
        }
    }
);

// `tier` renamed to `level`, version not bumped.
revision!(
    field_renamed,
    events = [PlanChanged, PlanCancelled],
    subscriber = "billing",
    {
        #[derive(Serialize, Deserialize, JsonSchema, OutboxEvent)]
        #[outbox(aggregate_type = "plan")]
        pub(crate) struct PlanChanged {
            #[outbox(aggregate_id)]
            pub(crate) plan_id: Uuid,
            pub(crate) level: String,
        }

        #[derive(Serialize, Deserialize, JsonSchema, OutboxEvent)]
        #[outbox(aggregate_type = "plan")]
        pub(crate) struct PlanCancelled {
            #[outbox(aggregate_id)]
            pub(crate) plan_id: Uuid,
        }
    }
);

// The proper change: version 2, with an upcaster from version 1.
revision!(
    bumped,
    events = [PlanChanged, PlanCancelled],
    subscriber = "billing",
    {
        #[derive(Serialize, Deserialize, JsonSchema, OutboxEvent)]
        #[outbox(aggregate_type = "plan", version = 2, upcast(from = 1, with = tier_to_level))]
        pub(crate) struct PlanChanged {
            #[outbox(aggregate_id)]
            pub(crate) plan_id: Uuid,
            pub(crate) level: String,
        }

        pub(crate) fn tier_to_level(mut data: Value) -> Result<Value, &'static str> {
            let object = data.as_object_mut().ok_or("not an object")?;
            let tier = object.remove("tier").ok_or("no `tier`")?;
            object.insert("level".into(), tier);
            Ok(data)
        }

        #[derive(Serialize, Deserialize, JsonSchema, OutboxEvent)]
        #[outbox(aggregate_type = "plan")]
        pub(crate) struct PlanCancelled {
            #[outbox(aggregate_id)]
            pub(crate) plan_id: Uuid,
        }
    }
);

// Version 2 kept, its upcaster from version 1 dropped.
revision!(
    upcaster_removed,
    events = [PlanChanged, PlanCancelled],
    subscriber = "billing",
    {
        #[derive(Serialize, Deserialize, JsonSchema, OutboxEvent)]
        #[outbox(aggregate_type = "plan", version = 2)]
        pub(crate) struct PlanChanged {
            #[outbox(aggregate_id)]
            pub(crate) plan_id: Uuid,
            pub(crate) level: String,
        }

        #[derive(Serialize, Deserialize, JsonSchema, OutboxEvent)]
        #[outbox(aggregate_type = "plan")]
        pub(crate) struct PlanCancelled {
            #[outbox(aggregate_id)]
            pub(crate) plan_id: Uuid,
        }
    }
);

// `PlanCancelled` removed.
revision!(
    event_removed,
    events = [PlanChanged],
    subscriber = "billing",
    {
        #[derive(Serialize, Deserialize, JsonSchema, OutboxEvent)]
        #[outbox(aggregate_type = "plan")]
        pub(crate) struct PlanChanged {
            #[outbox(aggregate_id)]
            pub(crate) plan_id: Uuid,
            pub(crate) tier: String,
        }
    }
);

// `PlanCancelled` renamed, declared; and the subscriber renamed, declared.
revision!(
    renamed,
    events = [PlanChanged, PlanEnded],
    subscriber = "ledger",
    formerly = ["billing"],
    {
        #[derive(Serialize, Deserialize, JsonSchema, OutboxEvent)]
        #[outbox(aggregate_type = "plan")]
        pub(crate) struct PlanChanged {
            #[outbox(aggregate_id)]
            pub(crate) plan_id: Uuid,
            pub(crate) tier: String,
        }

        #[derive(Serialize, Deserialize, JsonSchema, OutboxEvent)]
        #[outbox(aggregate_type = "plan", formerly = ["PlanCancelled"])]
        pub(crate) struct PlanEnded {
            #[outbox(aggregate_id)]
            pub(crate) plan_id: Uuid,
        }
    }
);

// The subscriber renamed without declaring it.
revision!(
    subscriber_renamed_silently,
    events = [PlanChanged, PlanCancelled],
    subscriber = "ledger",
    {
        #[derive(Serialize, Deserialize, JsonSchema, OutboxEvent)]
        #[outbox(aggregate_type = "plan")]
        pub(crate) struct PlanChanged {
            #[outbox(aggregate_id)]
            pub(crate) plan_id: Uuid,
            pub(crate) tier: String,
        }

        #[derive(Serialize, Deserialize, JsonSchema, OutboxEvent)]
        #[outbox(aggregate_type = "plan")]
        pub(crate) struct PlanCancelled {
            #[outbox(aggregate_id)]
            pub(crate) plan_id: Uuid,
        }
    }
);

/// The snapshot of the first revision.
fn first_snapshot() -> Value {
    bless_catalog(&first::App::catalog(), None).expect("the first revision records")
}

/// The breaking problems of `catalog` against `snapshot`.
fn breaking(catalog: &Catalog, snapshot: &Value) -> Vec<String> {
    compare_catalog(catalog, snapshot).unwrap().breaking
}

#[test]
fn the_snapshot_records_a_decodable_sample_and_the_schema_of_each_version() {
    let snapshot = first_snapshot();
    let changed = &snapshot["events"]["PlanChanged"]["versions"]["1"];
    assert_eq!(
        changed["sample"],
        serde_json::json!({"plan_id": "00000000-0000-0000-0000-000000000000", "tier": ""})
    );
    assert_eq!(
        changed["schema"]["required"],
        serde_json::json!(["plan_id", "tier"])
    );
    assert!(snapshot["subscribers"]["billing"].is_object());
    assert!(
        compare_catalog(&first::App::catalog(), &snapshot)
            .unwrap()
            .is_clean()
    );
}

#[test]
fn a_field_renamed_without_a_version_bump_fails_and_says_to_bump() {
    let problems = breaking(&field_renamed::App::catalog(), &first_snapshot());
    assert_eq!(problems.len(), 2, "{problems:#?}");
    assert!(
        problems[0]
            .starts_with("the recorded sample of `PlanChanged` version 1 no longer decodes (")
            && problems[0].contains("missing field `level`"),
        "{problems:#?}"
    );
    assert_eq!(
        problems[1],
        "the shape of `PlanChanged` version 1 changed without a version bump (fields added: \
         `level`; fields removed: `tier`): events stored at version 1 may no longer decode. \
         Bump it to `#[outbox(version = 2)]` and add `#[outbox(upcast(from = 1, with = ...))]`, \
         a function that turns version 1 data into version 2 data; if every stored payload \
         still decodes as it is (a new optional field, say), record the new shape with \
         OUTBOX_BLESS=1"
    );
    // And blessing refuses it: the recorded payloads would not decode.
    let refused = bless_catalog(&field_renamed::App::catalog(), Some(&first_snapshot()));
    assert!(refused.unwrap_err().starts_with("refusing to record"));
}

#[test]
fn the_proper_bump_with_an_upcaster_passes_and_is_recorded_beside_the_old_version() {
    let snapshot = first_snapshot();
    let report = compare_catalog(&bumped::App::catalog(), &snapshot).unwrap();
    assert_eq!(report.breaking, Vec::<String>::new());
    assert_eq!(
        report.unrecorded,
        [
            "`PlanChanged` version 2 is not recorded in the snapshot: run the test with \
          OUTBOX_BLESS=1 and commit the snapshot"
        ]
    );
    let blessed = bless_catalog(&bumped::App::catalog(), Some(&snapshot)).unwrap();
    let versions = blessed["events"]["PlanChanged"]["versions"]
        .as_object()
        .unwrap();
    assert_eq!(versions.keys().collect::<Vec<_>>(), ["1", "2"]);
    assert_eq!(
        versions["1"],
        snapshot["events"]["PlanChanged"]["versions"]["1"]
    );
    assert!(
        compare_catalog(&bumped::App::catalog(), &blessed)
            .unwrap()
            .is_clean()
    );
}

#[test]
fn a_removed_upcaster_fails_and_says_to_restore_it() {
    let blessed = bless_catalog(&bumped::App::catalog(), Some(&first_snapshot())).unwrap();
    let problems = breaking(&upcaster_removed::App::catalog(), &blessed);
    assert_eq!(
        problems,
        [
            "stored `PlanChanged` payloads of version 1 no longer decode: this build reads \
          versions 2..=2 only, so the upcaster from version 1 is gone and such events would be \
          dead letters. Restore `#[outbox(upcast(from = 1, with = ...))]` on `PlanChanged`"
        ]
    );
}

#[test]
fn a_removed_event_type_or_subscriber_fails_unless_the_rename_is_declared() {
    let snapshot = first_snapshot();
    assert_eq!(
        breaking(&event_removed::App::catalog(), &snapshot),
        [
            "event type `PlanCancelled` is gone from the catalog: events stored under that name \
          would be parked for ever. If the type was renamed, declare \
          `#[outbox(formerly = [\"PlanCancelled\"])]` on the type that replaces it; if it was \
          retired and no stored event has that name any more, delete it from the snapshot by \
          hand"
        ]
    );
    let problems = breaking(&subscriber_renamed_silently::App::catalog(), &snapshot);
    assert_eq!(problems.len(), 1, "{problems:#?}");
    assert!(
        problems[0].starts_with(
            "subscriber `billing` is gone from the router: deliveries stored under that name \
             would never be delivered. If it was renamed, declare \
             `#[subscriber(formerly = [\"billing\"])]` on the renamed one"
        ),
        "{problems:#?}"
    );

    // Declared renames pass, and once recorded the old names stay pinned to the new ones.
    let report = compare_catalog(&renamed::App::catalog(), &snapshot).unwrap();
    assert_eq!(report.breaking, Vec::<String>::new());
    let blessed = bless_catalog(&renamed::App::catalog(), Some(&snapshot)).unwrap();
    assert_eq!(
        blessed["events"]["PlanEnded"]["formerly"],
        serde_json::json!(["PlanCancelled"])
    );
    assert_eq!(
        blessed["subscribers"]["ledger"]["formerly"],
        serde_json::json!(["billing"])
    );
    assert!(
        compare_catalog(&renamed::App::catalog(), &blessed)
            .unwrap()
            .is_clean()
    );
    // Dropping the declaration later breaks again.
    let problems = breaking(&subscriber_renamed_silently::App::catalog(), &blessed);
    assert!(
        problems
            .iter()
            .any(|p| p.starts_with("event type `PlanEnded` is gone")),
        "{problems:#?}"
    );
    assert!(
        problems
            .iter()
            .any(|p| p.starts_with("subscriber `billing` is gone")),
        "{problems:#?}"
    );
}

#[test]
fn check_catalog_reads_the_committed_file_and_panics_with_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("catalog.json");
    // No snapshot yet.
    let missing = std::panic::catch_unwind(|| check_catalog::<first::App>(&path)).unwrap_err();
    let message = missing.downcast_ref::<String>().unwrap();
    assert!(
        message.contains("run the test with OUTBOX_BLESS=1 to record one"),
        "{message}"
    );

    std::fs::write(
        &path,
        serde_json::to_string_pretty(&first_snapshot()).unwrap(),
    )
    .unwrap();
    check_catalog::<first::App>(&path);
    let failed =
        std::panic::catch_unwind(|| check_catalog::<field_renamed::App>(&path)).unwrap_err();
    let message = failed.downcast_ref::<String>().unwrap();
    assert!(
        message.starts_with("the catalog of router `App` does not match its snapshot")
            && message.contains("- the shape of `PlanChanged` version 1 changed"),
        "{message}"
    );
}

// The event no longer derives `JsonSchema`.
revision!(
    schema_dropped,
    events = [PlanChanged],
    subscriber = "billing",
    {
        #[derive(Serialize, Deserialize, OutboxEvent)]
        #[outbox(aggregate_type = "plan")]
        pub(crate) struct PlanChanged {
            #[outbox(aggregate_id)]
            pub(crate) plan_id: Uuid,
            pub(crate) tier: String,
        }
    }
);

// A field whose type refuses the sample its schema gives (an empty string).
revision!(
    picky_field,
    events = [PlanChanged],
    subscriber = "billing",
    {
        #[derive(Serialize, Deserialize, JsonSchema, OutboxEvent)]
        #[outbox(aggregate_type = "plan")]
        pub(crate) struct PlanChanged {
            #[outbox(aggregate_id)]
            pub(crate) plan_id: Uuid,
            pub(crate) tier: Tier,
        }

        #[derive(Serialize, Deserialize, JsonSchema)]
        #[serde(try_from = "String")]
        pub(crate) struct Tier(String);

        impl TryFrom<String> for Tier {
            type Error = &'static str;

            fn try_from(tier: String) -> Result<Self, Self::Error> {
                if tier.is_empty() {
                    Err("a tier has a name")
                } else {
                    Ok(Self(tier))
                }
            }
        }
    }
);

#[test]
fn an_event_without_a_schema_a_version_gone_back_and_an_unsampleable_shape_are_reported() {
    let problems = breaking(&schema_dropped::App::catalog(), &first_snapshot());
    assert!(
        problems.contains(
            &"event `PlanChanged` does not derive `schemars::JsonSchema`: its shape cannot be \
              pinned; derive it beside `OutboxEvent`"
                .to_owned()
        ),
        "{problems:#?}"
    );
    let refused = bless_catalog(&schema_dropped::App::catalog(), None).unwrap_err();
    assert!(
        refused.contains("does not derive `schemars::JsonSchema`"),
        "{refused}"
    );

    let blessed = bless_catalog(&bumped::App::catalog(), Some(&first_snapshot())).unwrap();
    let problems = breaking(&first::App::catalog(), &blessed);
    assert!(
        problems.contains(
            &"`PlanChanged` is at version 1, but version 2 was recorded: stored events of \
              version 2 would be parked for ever; versions only go up"
                .to_owned()
        ),
        "{problems:#?}"
    );

    let refused = bless_catalog(&picky_field::App::catalog(), None).unwrap_err();
    assert!(
        refused.starts_with("could not make a sample of `PlanChanged` version 1 from its schema (")
            && refused.contains("a tier has a name")
            && refused.ends_with(
                "write one by hand in the snapshot, as `events.PlanChanged.versions.1.sample`"
            ),
        "{refused}"
    );
}

#[test]
fn a_snapshot_that_is_not_one_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("catalog.json");
    std::fs::write(&path, "{").unwrap();
    let failed = std::panic::catch_unwind(|| check_catalog::<first::App>(&path)).unwrap_err();
    let message = failed.downcast_ref::<String>().unwrap();
    assert!(message.contains("catalog.json is not JSON: "), "{message}");
    std::fs::write(&path, "{}").unwrap();
    let failed = std::panic::catch_unwind(|| check_catalog::<first::App>(&path)).unwrap_err();
    let message = failed.downcast_ref::<String>().unwrap();
    assert!(
        message.contains("catalog.json cannot be read: the snapshot has no `events` object; record it again with OUTBOX_BLESS=1"),
        "{message}"
    );
}
