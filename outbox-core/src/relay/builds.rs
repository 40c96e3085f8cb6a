//! Relays of different builds on one store, as in a rolling deploy.
//!
//! Each relay registers what its build routes ([`Store::register`]: event types with their
//! versions and subscribers, subscribers with their former names) and reads what the other live
//! relays route. From that it derives, in pure code:
//!
//! - what it leaves to the others ([`ClaimFilter`]): event types it does not route (or routes
//!   at an older version than another build) and subscribers it does not have, so that such
//!   work waits for a relay that can do it, without a park delay or a spent attempt;
//! - whom else an event it fans out goes to: the subscribers other builds route it to that this
//!   build lacks get a delivery of their own (waiting), so that a build without a subscriber
//!   does not decide that subscriber misses an event;
//! - names other builds declare as former names of one of this build's subscribers, which it
//!   reads as that subscriber.
//!
//! The registry is read when the relay starts, every [`HEARTBEAT`], and whenever a claim sees
//! its version change (a relay came or went), before that claim's batch is fanned out: a batch
//! claimed after another build registered is fanned out to that build's subscribers too.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::time::Instant;
use uuid::Uuid;

use crate::catalog::Catalog;
use crate::error::StoreError;
use crate::routing::Router;
use crate::store::{ClaimFilter, REGISTRATION_TTL, Registry, Store};
use crate::telemetry::{self, store_operation};

/// How often a relay renews its registration and reads the others'.
pub(crate) const HEARTBEAT: Duration = Duration::from_secs(10);

/// How this build's relays work with the others on the same tables, registered with its
/// routing (`"protocol"`), so that a store can keep to what relays of earlier builds expect
/// while one is live. Builds whose registration has no protocol are earlier than 1.
///
/// 1: a record of many delivery keys on PostgreSQL may take one lock of all keys instead of
/// each key's own (earlier builds take only each key's, so a store does so while one is live).
pub(crate) const RELAY_PROTOCOL: u32 = 1;

/// What this relay knows of the other builds.
#[derive(Debug, Default, Clone)]
pub(super) struct Others {
    /// The registry version this view was read at.
    version: Option<String>,
    /// What to leave to the others.
    filter: ClaimFilter,
    /// Event type (any name of it) -> the subscribers other builds route it to that this build
    /// does not have, by the names they registered.
    foreign: HashMap<String, Vec<String>>,
    /// A name another build declares as (a former name of) one of this build's subscribers.
    aliases: HashMap<String, &'static str>,
}

impl Others {
    /// The claim filter.
    pub(super) fn filter(&self) -> &ClaimFilter {
        &self.filter
    }

    /// The subscribers of other builds that take `event_type` and this build lacks.
    pub(super) fn foreign_subscribers(&self, event_type: &str) -> &[String] {
        self.foreign.get(event_type).map_or(&[], Vec::as_slice)
    }

    /// This build's subscriber that another build registered under `name`.
    pub(super) fn alias(&self, name: &str) -> Option<&'static str> {
        self.aliases.get(name).copied()
    }

    /// Whether another build routes `event_type`.
    pub(super) fn routes_event(&self, event_type: &str) -> bool {
        self.filter.skip_event_types.iter().any(|t| t == event_type)
            || self.foreign.contains_key(event_type)
    }

    /// Whether another build has a subscriber registered as `name`.
    pub(super) fn has_subscriber(&self, name: &str) -> bool {
        self.filter.skip_subscribers.iter().any(|s| s == name)
    }
}

/// A relay's registration: its id, its routing, and its view of the others.
pub(super) struct Builds {
    id: Uuid,
    routing: String,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    registered: Option<Instant>,
    /// Shared with the claims and batches that use it: read once per registry change.
    others: Arc<Others>,
}

impl Builds {
    /// The registration of a relay routing `catalog`.
    pub(super) fn new(catalog: &Catalog) -> Self {
        Self {
            id: uuid::Builder::from_random_bytes(fastrand::u128(..).to_le_bytes()).into_uuid(),
            routing: routing_json(catalog).to_string(),
            state: Mutex::new(State::default()),
        }
    }

    /// The relay's id in the registry.
    pub(super) fn id(&self) -> Uuid {
        self.id
    }

    /// The current view of the others.
    pub(super) fn others(&self) -> Arc<Others> {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .others
            .clone()
    }

    /// Registers and reads the others when the heartbeat is due (or never happened).
    pub(super) async fn renew_if_due<S: Store, R: Router>(
        &self,
        store: &S,
        router: &R,
    ) -> Result<(), StoreError> {
        let due = self
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .registered
            .is_none_or(|at| at.elapsed() >= HEARTBEAT);
        if due {
            self.renew(store, router).await?;
        }
        Ok(())
    }

    /// Registers and reads the others now.
    pub(super) async fn renew<S: Store, R: Router>(
        &self,
        store: &S,
        router: &R,
    ) -> Result<(), StoreError> {
        let registry = store
            .register(self.id, &self.routing, REGISTRATION_TTL)
            .await
            .inspect_err(|_| telemetry::store_error(store_operation::REGISTER))?;
        let others = view(self.id, &registry, router);
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if state.others.filter != others.filter || state.others.foreign != others.foreign {
            tracing::info!(
                relays = registry.relays.len(),
                left_to_others = ?others.filter,
                "outbox relay sees other builds' routing"
            );
        }
        state.registered = Some(Instant::now());
        state.others = Arc::new(others);
        Ok(())
    }

    /// Whether a claim that saw registry version `seen` needs the registry read again.
    pub(super) fn is_stale(&self, seen: Option<&String>) -> bool {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        seen.is_some() && seen != state.others.version.as_ref()
    }

    /// Ends the registration.
    pub(super) async fn unregister<S: Store>(&self, store: &S) {
        if let Err(error) = store.unregister(self.id).await {
            telemetry::store_error(store_operation::REGISTER);
            tracing::debug!(%error, "outbox relay could not end its registration");
        }
    }
}

/// What a build registers: `{"events": [{"type", "formerly", "version", "subscribers"}],
/// "subscribers": [{"name", "formerly"}], "protocol": RELAY_PROTOCOL}`.
pub(crate) fn routing_json(catalog: &Catalog) -> Value {
    let events: Vec<Value> = catalog
        .events()
        .iter()
        .map(|e| {
            json!({
                "type": e.event_type,
                "formerly": e.formerly,
                "version": e.version,
                "subscribers": e.subscribers,
            })
        })
        .collect();
    let subscribers: Vec<Value> = catalog
        .subscribers()
        .iter()
        .map(|s| json!({"name": s.name, "formerly": s.formerly}))
        .collect();
    json!({"events": events, "subscribers": subscribers, "protocol": RELAY_PROTOCOL})
}

fn names(value: &Value, current: &str) -> Vec<String> {
    let mut out = vec![value[current].as_str().unwrap_or_default().to_owned()];
    if let Some(formerly) = value["formerly"].as_array() {
        out.extend(formerly.iter().filter_map(Value::as_str).map(str::to_owned));
    }
    out.retain(|n| !n.is_empty());
    out
}

/// The union of what every relay of `registry` but `me` routes, seen from `router`'s build.
pub(super) fn view<R: Router>(me: Uuid, registry: &Registry, router: &R) -> Others {
    let catalog = R::catalog();
    let own_version = |name: &str| catalog.event(name).map(|e| e.version);
    let mut others = Others {
        version: Some(registry.version.clone()),
        ..Others::default()
    };
    let mut skip_types: HashSet<String> = HashSet::new();
    let mut skip_subscribers: HashSet<String> = HashSet::new();
    for (id, routing) in &registry.relays {
        if *id == me {
            continue;
        }
        let Ok(routing) = serde_json::from_str::<Value>(routing) else {
            tracing::warn!(relay = %id, "outbox relay ignores a registration it cannot read");
            continue;
        };
        // Its subscribers: this build's own (by name, or declared former names), or foreign.
        let mut own_of: HashMap<String, &'static str> = HashMap::new();
        for subscriber in routing["subscribers"].as_array().into_iter().flatten() {
            let all = names(subscriber, "name");
            let own = all.iter().find_map(|n| router.current_subscriber(n));
            for name in &all {
                match own {
                    Some(own) => {
                        own_of.insert(name.clone(), own);
                        if router.current_subscriber(name).is_none() {
                            others.aliases.insert(name.clone(), own);
                        }
                    }
                    None => {
                        skip_subscribers.insert(name.clone());
                    }
                }
            }
        }
        for event in routing["events"].as_array().into_iter().flatten() {
            let all = names(event, "type");
            let version = event["version"].as_u64().unwrap_or(1);
            let known = all.iter().find_map(|n| own_version(n).map(|v| (n, v)));
            match known {
                // Another build reads it at a newer version: leave it to that build.
                Some((_, own)) if u64::from(own) < version => {
                    skip_types.extend(all.iter().filter(|n| catalog.event(n).is_some()).cloned());
                }
                Some(_) => {}
                None => skip_types.extend(all.iter().cloned()),
            }
            let foreign: Vec<String> = event["subscribers"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .filter(|s| !own_of.contains_key(*s) && router.current_subscriber(s).is_none())
                .map(str::to_owned)
                .collect();
            if foreign.is_empty() {
                continue;
            }
            for name in &all {
                let list = others.foreign.entry(name.clone()).or_default();
                for subscriber in &foreign {
                    if !list.contains(subscriber) {
                        list.push(subscriber.clone());
                    }
                }
            }
        }
    }
    let mut skip_types: Vec<String> = skip_types.into_iter().collect();
    let mut skip_subscribers: Vec<String> = skip_subscribers.into_iter().collect();
    skip_types.sort();
    skip_subscribers.sort();
    others.filter = ClaimFilter::new(skip_types, skip_subscribers);
    others
}
