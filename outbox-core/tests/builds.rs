//! Relays of two builds on one store, in memory: an event type the newer build reads at a
//! newer version is left to the newer build, not parked by the older one.

use std::sync::{Arc, Mutex};

use outbox_core::testing::MemoryStore;
use outbox_core::{
    Delivery, Handle, HandlerError, OutboxEvent, Relay, RelayConfig, Store, router, subscriber,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

mod old {
    use super::*;

    /// Version 1: a plan's `tier`.
    #[derive(Serialize, Deserialize, OutboxEvent)]
    #[outbox(aggregate_type = "plan", event_type = "PlanChanged")]
    pub(crate) struct PlanChanged {
        #[outbox(aggregate_id)]
        pub(crate) plan: Uuid,
        pub(crate) tier: String,
    }
}

mod new {
    use super::*;

    /// Version 2: `tier` became `level`.
    #[derive(Serialize, Deserialize, OutboxEvent)]
    #[outbox(aggregate_type = "plan", event_type = "PlanChanged", version = 2)]
    #[outbox(upcast(from = 1, with = tier_to_level))]
    pub(crate) struct PlanChanged {
        #[outbox(aggregate_id)]
        pub(crate) plan: Uuid,
        pub(crate) level: String,
    }

    fn tier_to_level(mut data: Value) -> Result<Value, &'static str> {
        let object = data.as_object_mut().ok_or("not an object")?;
        let tier = object.remove("tier").ok_or("no tier")?;
        object.insert("level".into(), tier);
        Ok(data)
    }
}

type Seen = Arc<Mutex<Vec<&'static str>>>;

#[subscriber(events = [old::PlanChanged], name = "billing")]
struct OldBilling(Seen);

impl Handle<old::PlanChanged> for OldBilling {
    async fn handle(&self, _: &old::PlanChanged, _: &Delivery<'_>) -> Result<(), HandlerError> {
        self.0.lock().unwrap().push("old");
        Ok(())
    }
}

#[subscriber(events = [new::PlanChanged], name = "billing")]
struct NewBilling(Seen);

impl Handle<new::PlanChanged> for NewBilling {
    async fn handle(&self, _: &new::PlanChanged, _: &Delivery<'_>) -> Result<(), HandlerError> {
        self.0.lock().unwrap().push("new");
        Ok(())
    }
}

#[router(events = [old::PlanChanged])]
struct OldApp {
    billing: OldBilling,
}

#[router(events = [new::PlanChanged])]
struct NewApp {
    billing: NewBilling,
}

#[tokio::test]
async fn a_type_another_build_reads_at_a_newer_version_is_left_to_it_not_parked() {
    let store = MemoryStore::new();
    let seen = Seen::default();
    let old = Relay::new(
        store.clone(),
        OldApp {
            billing: OldBilling(seen.clone()),
        },
        RelayConfig::default(),
    )
    .unwrap();
    let new = Relay::new(
        store.clone(),
        NewApp {
            billing: NewBilling(seen.clone()),
        },
        RelayConfig::default(),
    )
    .unwrap();
    // Both registered, and the old one has read the new one's registration.
    old.run_once().await.unwrap();
    new.run_once().await.unwrap();
    old.run_once().await.unwrap();

    let plan = Uuid::new_v4();
    store
        .publish(&new::PlanChanged {
            plan,
            level: "pro".into(),
        })
        .unwrap();
    let report = old.run_once().await.unwrap();
    assert_eq!((report.claimed, report.parked), (0, 0), "{report:?}");
    let report = new.run_once().await.unwrap();
    assert_eq!(report.delivered, 1, "{report:?}");
    assert_eq!(*seen.lock().unwrap(), ["new"]);
    assert!(store.events().iter().all(|e| e.published && e.parked == 0));

    // Once the newer build is gone (its registration ended), the old one takes the type again.
    new.store().unregister(new.id()).await.unwrap();
    store
        .publish(&old::PlanChanged {
            plan,
            tier: "basic".into(),
        })
        .unwrap();
    old.run_once().await.unwrap(); // reads the registry change
    outbox_core::testing::drain(&old).await.unwrap();
    assert_eq!(*seen.lock().unwrap(), ["new", "old"]);
}
