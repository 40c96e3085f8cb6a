//! Successions: a relay's next claim takes over the aggregates of its own claims still under
//! way, so that an aggregate's later events reach its keys without waiting for a claim made
//! after its slowest key and its record.
//!
//! Every batch of a store that [takes over](crate::store::Store::claims_take_over) enters its
//! aggregates here for as long as its claim lives ([`Successions::hold`]). The relay's claims
//! name them ([`TakeOver`]), so the store lets them claim those aggregates' later events; the
//! batch that does waits, per aggregate, for the work before it ([`Gate`]): its calls of an
//! aggregate start only once the claim before recorded its work on that aggregate, clean
//! (every event published, every call delivered). If that work is not recorded (the record
//! failed, the lease was lost) or did not end clean (a failure left a delivery behind, an event
//! was parked or dead-lettered), the later events are given back unstarted: a later claim
//! finds them behind what is left, as it would have without the take-over (deliveries, which
//! claims take as due with or without it, run as they would have). An aggregate whose work
//! ended unclean is not taken over again until a batch of it ends clean: what a claim took
//! over from it would be given back, claim after claim, while its events keep coming. So an
//! aggregate's events still reach each subscriber in order, and a handling that is repeated
//! (a record lost) is followed by its later events again, never overtaken by them.

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::watch;
use uuid::Uuid;

use crate::store::{ClaimToken, TakeOver};

/// An aggregate: (type, id).
pub(super) type Aggregate = (String, Uuid);

/// One claim's work on one aggregate.
struct Held {
    /// The aggregate's type.
    kind: String,
    /// How it ended: `None` while it runs or its record is under way; `Some(true)` once
    /// recorded clean; `Some(false)` otherwise.
    ending: watch::Sender<Option<bool>>,
    /// Whether its calls are over (clean; its record is under way).
    done: bool,
}

/// One claim's aggregates, by id (then type: ids are almost always unique), so that they are
/// found without building a key.
type Claimed = HashMap<Uuid, Vec<Held>>;

fn find<'a>(claimed: &'a mut Claimed, (kind, id): (&str, Uuid)) -> Option<&'a mut Vec<Held>> {
    claimed
        .get_mut(&id)
        .filter(|held| held.iter().any(|h| h.kind == kind))
}

/// Takes `aggregate`'s entry out of `claimed`.
fn take(claimed: &mut Claimed, (kind, id): (&str, Uuid)) -> Option<Held> {
    let held = claimed.get_mut(&id)?;
    let at = held.iter().position(|h| h.kind == kind)?;
    let taken = held.swap_remove(at);
    if held.is_empty() {
        claimed.remove(&id);
    }
    Some(taken)
}

/// The aggregates of a relay's live claims whose work has not ended.
#[derive(Default)]
pub(super) struct Successions {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    claims: HashMap<ClaimToken, Claimed>,
    /// Aggregates whose last work ended other than clean (a key blocked behind a failure, an
    /// event parked or dead): not taken over until a batch of theirs ends clean again, since
    /// what a claim took over from them would only be given back, claim after claim.
    troubled: HashSet<Aggregate>,
}

/// The most troubled aggregates remembered (then they are forgotten, and at worst taken over
/// once more each).
const TROUBLED_KEPT: usize = 10_000;

impl State {
    /// `aggregate`'s work in claim `token` ended: `clean`, or not.
    fn end(&mut self, token: ClaimToken, aggregate: (&str, Uuid), clean: bool) {
        let Some(claimed) = self.claims.get_mut(&token) else {
            return;
        };
        let Some(held) = take(claimed, aggregate) else {
            return;
        };
        held.ending.send_replace(Some(clean));
        if clean {
            self.troubled.remove(&(aggregate.0.to_owned(), aggregate.1));
        } else {
            if self.troubled.len() >= TROUBLED_KEPT {
                self.troubled.clear();
            }
            self.troubled.insert((aggregate.0.to_owned(), aggregate.1));
        }
    }
}

impl Successions {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Enters the aggregates of claim `token`, whose batch starts, until the returned guard is
    /// dropped (after the claim's last record): what has not ended clean by then ends unclean.
    pub(super) fn hold<'a>(
        &self,
        token: ClaimToken,
        aggregates: impl IntoIterator<Item = (&'a str, Uuid)>,
    ) -> Holding<'_> {
        let mut claimed = Claimed::new();
        for (kind, id) in aggregates {
            let held = claimed.entry(id).or_default();
            if !held.iter().any(|h| h.kind == kind) {
                held.push(Held {
                    kind: kind.to_owned(),
                    ending: watch::Sender::new(None),
                    done: false,
                });
            }
        }
        self.lock().claims.insert(token, claimed);
        Holding {
            successions: self,
            token,
        }
    }

    /// The record of claim `token`'s work on `clean`, all of it clean, was applied.
    pub(super) fn recorded(&self, token: ClaimToken, clean: &[Aggregate]) {
        self.end(
            token,
            clean.iter().map(|(kind, id)| (kind.as_str(), *id)),
            true,
        );
    }

    /// The calls of claim `token` on `aggregates` are over; `clean` says which ended clean
    /// (their record is under way). What was claimed after the others is given back.
    pub(super) fn settled<'a>(
        &self,
        token: ClaimToken,
        aggregates: impl Iterator<Item = (&'a str, Uuid)>,
        clean: impl Fn((&str, Uuid)) -> bool,
    ) {
        let mut state = self.lock();
        for aggregate in aggregates {
            if !clean(aggregate) {
                state.end(token, aggregate, false);
            } else if let Some(held) = state
                .claims
                .get_mut(&token)
                .and_then(|claimed| find(claimed, aggregate))
            {
                held.iter_mut()
                    .filter(|h| h.kind == aggregate.0)
                    .for_each(|h| h.done = true);
            }
        }
    }

    fn end<'a>(
        &self,
        token: ClaimToken,
        aggregates: impl Iterator<Item = (&'a str, Uuid)>,
        clean: bool,
    ) {
        let mut state = self.lock();
        for aggregate in aggregates {
            state.end(token, aggregate, clean);
        }
    }

    /// What a claim made now may take over, and the gate its batch waits at: the aggregates
    /// one claim holds. (Not those two hold, the second waiting for the first: a relay keeps
    /// at most one claim of an aggregate's events waiting, not as many as it could claim.)
    pub(super) fn take_over(&self, waits_at_most: Duration) -> (Vec<TakeOver>, Gate) {
        let state = self.lock();
        let mut holders: HashMap<(&str, Uuid), (ClaimToken, &Held, usize)> = HashMap::new();
        for (&token, claimed) in &state.claims {
            for (&id, held) in claimed {
                for work in held {
                    holders
                        .entry((work.kind.as_str(), id))
                        .or_insert((token, work, 0))
                        .2 += 1;
                }
            }
        }
        let mut take_over: HashMap<ClaimToken, Vec<Aggregate>> = HashMap::new();
        let mut waits: HashMap<Uuid, Vec<Wait>> = HashMap::new();
        for ((kind, id), (token, work, holders)) in holders {
            if holders == 1 && !state.troubled.contains(&(kind.to_owned(), id)) {
                take_over
                    .entry(token)
                    .or_default()
                    .push((kind.to_owned(), id));
                waits.entry(id).or_default().push(Wait {
                    kind: kind.to_owned(),
                    ending: work.ending.subscribe(),
                    calls_running: !work.done,
                });
            }
        }
        let take_over = take_over
            .into_iter()
            .map(|(token, aggregates)| TakeOver::new(token, aggregates))
            .collect();
        (
            take_over,
            Gate {
                waits,
                waits_at_most,
            },
        )
    }
}

/// Claim `token`'s entry in [`Successions`]: dropped, whatever has not ended ends unclean.
pub(super) struct Holding<'a> {
    successions: &'a Successions,
    token: ClaimToken,
}

impl Drop for Holding<'_> {
    fn drop(&mut self) {
        let mut state = self.successions.lock();
        let left: Vec<Aggregate> = state
            .claims
            .get(&self.token)
            .into_iter()
            .flat_map(|claimed| {
                claimed
                    .iter()
                    .flat_map(|(&id, held)| held.iter().map(move |h| (h.kind.clone(), id)))
            })
            .collect();
        for (kind, id) in &left {
            state.end(self.token, (kind, *id), false);
        }
        state.claims.remove(&self.token);
    }
}

/// How a batch waits for the work before on one aggregate it took over.
struct Wait {
    kind: String,
    ending: watch::Receiver<Option<bool>>,
    /// Whether the calls before still ran when the batch was claimed.
    calls_running: bool,
}

/// The aggregates a batch took over from the relay's earlier claims, and how their work there
/// ends. No handler of their events starts before it ended clean; if it does not, their claims
/// are given back.
pub(super) struct Gate {
    waits: HashMap<Uuid, Vec<Wait>>,
    /// How long a key waits at most (then its claims are given back): a bound, should a claim
    /// before never end.
    waits_at_most: Duration,
}

impl Gate {
    fn get(&self, (kind, id): (&str, Uuid)) -> Option<&Wait> {
        self.waits.get(&id)?.iter().find(|w| w.kind == kind)
    }

    /// Whether `aggregate` was taken over.
    pub(super) fn holds(&self, aggregate: (&str, Uuid)) -> bool {
        self.get(aggregate).is_some()
    }

    /// Whether `aggregate` was taken over from calls still running then (not only a record
    /// under way): its keys may wait as long as a retry in place.
    pub(super) fn waits_on_calls(&self, aggregate: (&str, Uuid)) -> bool {
        self.get(aggregate).is_some_and(|w| w.calls_running)
    }

    /// Whether the claims of `aggregate` are given back: it was taken over, and the work
    /// before did not end clean (or has not yet).
    pub(super) fn gives_back(&self, aggregate: (&str, Uuid)) -> bool {
        self.get(aggregate)
            .is_some_and(|w| *w.ending.borrow() != Some(true))
    }

    /// Waits until the work before on `aggregate` ended: whether it ended clean (true at once
    /// if it was not taken over).
    pub(super) async fn wait(&self, aggregate: (&str, Uuid)) -> bool {
        let Some(wait) = self.get(aggregate) else {
            return true;
        };
        let mut ending = wait.ending.clone();
        let ended = async {
            matches!(
                ending.wait_for(Option::is_some).await.as_deref(),
                Ok(Some(true))
            )
        };
        tokio::time::timeout(self.waits_at_most, ended)
            .await
            .unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agg(n: u128) -> Aggregate {
        ("t".to_owned(), id(n))
    }

    fn id(n: u128) -> Uuid {
        Uuid::from_u128(n)
    }

    #[tokio::test]
    async fn later_work_waits_for_the_work_before_and_runs_only_after_it_ended_clean() {
        let successions = Successions::default();
        let (first, second) = (ClaimToken::new(1), ClaimToken::new(2));
        let holding = successions.hold(first, [("t", id(1)), ("t", id(2)), ("t", id(3))]);
        let (take_over, gate) = successions.take_over(Duration::from_secs(60));
        assert_eq!(take_over.len(), 1);
        assert_eq!(take_over[0].claim, first);
        assert_eq!(take_over[0].aggregates.len(), 3);
        let later = successions.hold(second, [("t", id(1))]);
        let (take_over, _) = successions.take_over(Duration::from_secs(60));
        assert_eq!(
            take_over[0].aggregates.len(),
            2,
            "not aggregate 1, which a claim already waits for: {take_over:?}"
        );

        assert!(gate.holds(("t", Uuid::from_u128(1))));
        assert!(!gate.holds(("t", Uuid::from_u128(4))));
        assert!(gate.gives_back(("t", Uuid::from_u128(1))), "not ended yet");
        successions.settled(first, [("t", id(1)), ("t", id(2))].into_iter(), |a| {
            a == ("t", id(1))
        });
        let (take_over, gate_after) = successions.take_over(Duration::from_secs(60));
        assert!(
            !gate_after.waits_on_calls(("t", Uuid::from_u128(1))),
            "done: {take_over:?}"
        );
        assert!(
            gate_after.waits_on_calls(("t", Uuid::from_u128(3))),
            "still running"
        );
        assert!(
            !gate_after.holds(("t", Uuid::from_u128(2))),
            "ended unclean"
        );
        successions.recorded(first, &[agg(1)]);
        assert!(gate.wait(("t", Uuid::from_u128(1))).await);
        assert!(!gate.gives_back(("t", Uuid::from_u128(1))));
        assert!(!gate.wait(("t", Uuid::from_u128(2))).await);
        assert!(gate.gives_back(("t", Uuid::from_u128(2))));
        assert!(gate.wait(("t", Uuid::from_u128(4))).await, "not taken over");
        // Aggregate 3 never ended: the claim's end says so.
        let waiting = gate.wait(("t", Uuid::from_u128(3)));
        drop(holding);
        assert!(!waiting.await);
        drop(later);
        let (take_over, _) = successions.take_over(Duration::from_secs(60));
        assert!(take_over.is_empty());

        // Aggregate 2 ended unclean: it is not taken over until a batch of it ends clean.
        let third = ClaimToken::new(3);
        let _third = successions.hold(third, [("t", id(2))]);
        let (_, gate) = successions.take_over(Duration::from_secs(60));
        assert!(!gate.holds(("t", id(2))), "troubled");
        successions.recorded(third, &[agg(2)]);
        let _fourth = successions.hold(ClaimToken::new(4), [("t", id(2))]);
        let (_, gate) = successions.take_over(Duration::from_secs(60));
        assert!(gate.holds(("t", id(2))), "clean again");
    }

    #[tokio::test(start_paused = true)]
    async fn a_key_waits_for_the_work_before_at_most_its_bound() {
        let successions = Successions::default();
        let _holding = successions.hold(ClaimToken::new(1), [("t", id(1))]);
        let (_, gate) = successions.take_over(Duration::from_secs(8));
        assert!(!gate.wait(("t", Uuid::from_u128(1))).await);
    }
}
