//! Successions: a relay's next claim takes over the aggregates of its own claims still under
//! way, so that an aggregate's later events reach its keys without waiting for a claim made
//! after its slowest key and its record.
//!
//! Every batch of a store that [takes over](crate::store::Store::claims_take_over) enters its
//! aggregates here for as long as its claim lives ([`Successions::hold`]). The relay's claims
//! name them ([`TakeOver`]; a claim all of whose aggregates under way are taken over is named
//! whole), so the store lets them claim those aggregates' later events; the
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

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::watch;
use uuid::Uuid;

use super::{Map, Set};
use crate::store::{ClaimToken, TakeOver};

/// An aggregate: (type, id).
pub(super) type Aggregate = (String, Uuid);

/// An aggregate within one claim's [`Work`]: its id and the index of its type in
/// [`Work::kinds`] (a claim has few types; an entry is then found without building a key).
type Slot = (Uuid, u32);

/// How one claim's work on one aggregate stands.
#[derive(Clone, Copy, Default)]
struct Entry {
    /// `None` while it runs or its record is under way; `Some(true)` once recorded clean;
    /// `Some(false)` otherwise.
    ending: Option<bool>,
    /// When its calls were over (clean; its record is under way), on the successions' clock.
    done: Option<u64>,
}

/// One claim's work: its aggregates and how each stands. Kept (by the gates of the claims that
/// took some over) after the claim's end, so that how each ended can still be read.
struct Work {
    /// The aggregate types of the claim.
    kinds: Vec<Box<str>>,
    state: Mutex<WorkState>,
    /// Sent to each time the work on some of its aggregates ends.
    ended: watch::Sender<()>,
}

#[derive(Default)]
struct WorkState {
    entries: Map<Slot, Entry>,
    /// Whether the work on some aggregate ended other than clean.
    unclean: bool,
}

impl Work {
    fn slot(&self, (kind, id): (&str, Uuid)) -> Option<Slot> {
        let kind = self.kinds.iter().position(|k| **k == *kind)?;
        Some((id, u32::try_from(kind).ok()?))
    }

    fn kind(&self, (_, kind): Slot) -> &str {
        &self.kinds[kind as usize]
    }

    fn lock(&self) -> MutexGuard<'_, WorkState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The aggregates of a relay's live claims whose work has not ended.
#[derive(Default)]
pub(super) struct Successions {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    claims: Map<ClaimToken, Arc<Work>>,
    /// Aggregates whose last work ended other than clean (a key blocked behind a failure, an
    /// event parked or dead), by id: not taken over until a batch of theirs ends clean again,
    /// since what a claim took over from them would only be given back, claim after claim.
    troubled: Map<Uuid, Vec<Box<str>>>,
    /// Counts the settlements of calls, so that a gate knows which calls were over before it.
    clock: u64,
}

/// The most troubled aggregates remembered (then they are forgotten, and at worst taken over
/// once more each).
const TROUBLED_KEPT: usize = 10_000;

impl State {
    fn is_troubled(&self, (kind, id): (&str, Uuid)) -> bool {
        self.troubled
            .get(&id)
            .is_some_and(|kinds| kinds.iter().any(|k| **k == *kind))
    }

    /// The work on `aggregate` ended, `clean` or not: it is troubled until a batch of it ends
    /// clean.
    fn note_ending(&mut self, (kind, id): (&str, Uuid), clean: bool) {
        if clean {
            if let Some(kinds) = self.troubled.get_mut(&id) {
                kinds.retain(|k| **k != *kind);
                if kinds.is_empty() {
                    self.troubled.remove(&id);
                }
            }
        } else if !self.is_troubled((kind, id)) {
            if self.troubled.len() >= TROUBLED_KEPT {
                self.troubled.clear();
            }
            self.troubled.entry(id).or_default().push(kind.into());
        }
    }

    /// Ends the work of claim `token` on `aggregates` (those still under way), `clean` or
    /// not, and tells the gates waiting for it.
    fn end<'a>(
        &mut self,
        token: ClaimToken,
        aggregates: impl Iterator<Item = (&'a str, Uuid)>,
        clean: bool,
    ) {
        let Some(work) = self.claims.get(&token).cloned() else {
            return;
        };
        let mut ended = false;
        {
            let mut state = work.lock();
            for aggregate in aggregates {
                let Some(entry) = work.slot(aggregate).and_then(|s| state.entries.get_mut(&s))
                else {
                    continue;
                };
                if entry.ending.is_some() {
                    continue;
                }
                entry.ending = Some(clean);
                state.unclean |= !clean;
                ended = true;
                self.note_ending(aggregate, clean);
            }
        }
        if ended {
            work.ended.send_replace(());
        }
    }
}

impl Successions {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Enters the aggregates of claim `token`, just claimed, until the returned guard is
    /// dropped (after the claim's last record): what has not ended clean by then ends unclean.
    pub(super) fn hold<'a>(
        &self,
        token: ClaimToken,
        aggregates: impl IntoIterator<Item = (&'a str, Uuid)>,
    ) -> Holding<'_> {
        let mut kinds: Vec<Box<str>> = Vec::new();
        let mut entries = Map::default();
        for (kind, id) in aggregates {
            let at = match kinds.iter().position(|k| **k == *kind) {
                Some(at) => at,
                None => {
                    kinds.push(kind.into());
                    kinds.len() - 1
                }
            };
            // (More than four billion types in one batch cannot be.)
            if let Ok(at) = u32::try_from(at) {
                entries.insert((id, at), Entry::default());
            }
        }
        let work = Work {
            kinds,
            state: Mutex::new(WorkState {
                entries,
                unclean: false,
            }),
            ended: watch::Sender::new(()),
        };
        self.lock().claims.insert(token, Arc::new(work));
        Holding {
            successions: self,
            token,
        }
    }

    /// The record of claim `token`'s work on `clean`, all of it clean, was applied.
    pub(super) fn recorded(&self, token: ClaimToken, clean: &[Aggregate]) {
        self.lock().end(
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
        let Some(work) = state.claims.get(&token).cloned() else {
            return;
        };
        state.clock += 1;
        let now = state.clock;
        let mut unclean = Vec::new();
        {
            let mut entries = work.lock();
            for aggregate in aggregates {
                if !clean(aggregate) {
                    unclean.push(aggregate);
                } else if let Some(entry) = work
                    .slot(aggregate)
                    .and_then(|s| entries.entries.get_mut(&s))
                {
                    entry.done = Some(now);
                }
            }
        }
        state.end(token, unclean.into_iter(), false);
    }

    /// What a claim made now may take over, and the gate its batch waits at: the aggregates
    /// one claim holds. (Not those two hold, the second waiting for the first: a relay keeps
    /// at most one claim of an aggregate's events waiting, not as many as it could claim.) A
    /// claim all of whose aggregates still under way may be taken over, and none of whose work
    /// ended unclean, is taken over whole: nothing is listed.
    pub(super) fn take_over(&self, waits_at_most: Duration) -> (Vec<TakeOver>, Gate) {
        let state = self.lock();
        let mut works: Vec<(ClaimToken, &Arc<Work>)> =
            state.claims.iter().map(|(t, w)| (*t, w)).collect();
        works.sort_unstable_by_key(|(token, _)| *token);
        // (Locked in the order of their tokens, under the successions' lock; a gate locks one
        // at a time.)
        let locked: Vec<MutexGuard<'_, WorkState>> = works.iter().map(|(_, w)| w.lock()).collect();
        // Whether another claim than the `i`th holds `aggregate`, its work there under way.
        let elsewhere = |i: usize, aggregate: (&str, Uuid)| {
            works
                .iter()
                .zip(&locked)
                .enumerate()
                .any(|(j, ((_, work), entries))| {
                    j != i
                        && work
                            .slot(aggregate)
                            .and_then(|s| entries.entries.get(&s))
                            .is_some_and(|e| e.ending.is_none())
                })
        };
        let mut take_over = Vec::new();
        let mut claims = Vec::new();
        for (i, ((token, work), entries)) in works.iter().zip(&locked).enumerate() {
            let may_take = |(&slot, entry): (&Slot, &Entry)| {
                let aggregate = (work.kind(slot), slot.0);
                entry.ending.is_none()
                    && !state.is_troubled(aggregate)
                    && !(works.len() > 1 && elsewhere(i, aggregate))
            };
            let (mut under_way, mut taken) = (0, 0);
            for (slot, entry) in &entries.entries {
                under_way += usize::from(entry.ending.is_none());
                taken += usize::from(may_take((slot, entry)));
            }
            if taken == 0 {
                continue;
            }
            if !entries.unclean && taken == under_way {
                take_over.push(TakeOver::whole(*token));
                claims.push(((*work).clone(), None));
            } else {
                let taken: Set<Slot> = entries
                    .entries
                    .iter()
                    .filter(|&e| may_take(e))
                    .map(|(&slot, _)| slot)
                    .collect();
                let aggregates = taken
                    .iter()
                    .map(|&slot| (work.kind(slot).to_owned(), slot.0))
                    .collect();
                take_over.push(TakeOver::new(*token, aggregates));
                claims.push(((*work).clone(), Some(taken)));
            }
        }
        (
            take_over,
            Gate {
                claims,
                taken_at: state.clock,
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
        let Some(work) = state.claims.get(&self.token).cloned() else {
            return;
        };
        let left: Vec<Slot> = work
            .lock()
            .entries
            .iter()
            .filter(|(_, e)| e.ending.is_none())
            .map(|(&slot, _)| slot)
            .collect();
        state.end(
            self.token,
            left.iter().map(|&slot| (work.kind(slot), slot.0)),
            false,
        );
        state.claims.remove(&self.token);
    }
}

/// The aggregates a batch took over from the relay's earlier claims, and how their work there
/// ends. No handler of their events starts before it ended clean; if it does not, their claims
/// are given back.
pub(super) struct Gate {
    /// The claims taken over from: whole (`None`: every aggregate of theirs), or those named.
    claims: Vec<(Arc<Work>, Option<Set<Slot>>)>,
    /// When the claim was made, on the successions' clock.
    taken_at: u64,
    /// How long a key waits at most (then its claims are given back): a bound, should a claim
    /// before never end.
    waits_at_most: Duration,
}

impl Gate {
    /// The claims `aggregate` was taken over from, with how their work on it stands (each read
    /// under one lock).
    fn works(&self, aggregate: (&str, Uuid)) -> impl Iterator<Item = (&Work, Slot, Entry)> {
        self.claims.iter().filter_map(move |(work, taken)| {
            let slot = work.slot(aggregate)?;
            if taken.as_ref().is_some_and(|taken| !taken.contains(&slot)) {
                return None;
            }
            let entry = *work.lock().entries.get(&slot)?;
            Some((&**work, slot, entry))
        })
    }

    /// How the work before on `aggregate` stands, in each claim it was taken over from.
    fn entries(&self, aggregate: (&str, Uuid)) -> impl Iterator<Item = Entry> {
        self.works(aggregate).map(|(_, _, entry)| entry)
    }

    /// Whether `aggregate` was taken over.
    pub(super) fn holds(&self, aggregate: (&str, Uuid)) -> bool {
        self.works(aggregate).next().is_some()
    }

    /// Whether `aggregate` was taken over from calls still running then (not only a record
    /// under way): its keys may wait as long as a retry in place.
    pub(super) fn waits_on_calls(&self, aggregate: (&str, Uuid)) -> bool {
        self.entries(aggregate)
            .any(|e| e.ending.is_none() && e.done.is_none_or(|settled| settled > self.taken_at))
    }

    /// Whether the claims of `aggregate` are given back: it was taken over, and the work
    /// before did not end clean (or has not yet).
    pub(super) fn gives_back(&self, aggregate: (&str, Uuid)) -> bool {
        self.entries(aggregate).any(|e| e.ending != Some(true))
    }

    /// Waits until the work before on `aggregate` ended: whether it ended clean (true at once
    /// if it was not taken over).
    pub(super) async fn wait(&self, aggregate: (&str, Uuid)) -> bool {
        let works: Vec<(&Work, Slot)> = self
            .works(aggregate)
            .map(|(work, slot, _)| (work, slot))
            .collect();
        let ended = async {
            for (work, slot) in works {
                // (Subscribed before the look: an ending after it is told.)
                let mut told = work.ended.subscribe();
                loop {
                    match work.lock().entries.get(&slot).and_then(|e| e.ending) {
                        Some(true) => break,
                        Some(false) => return false,
                        None => {}
                    }
                    // (The sender lives as long as the work.)
                    let _ = told.changed().await;
                }
            }
            true
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

    /// The aggregates `take_over` names of `claim`, sorted; `None` if it takes it over whole.
    fn named(take_over: &[TakeOver], claim: ClaimToken) -> Option<Vec<u128>> {
        let t = take_over.iter().find(|t| t.claim == claim).unwrap();
        (!t.whole).then(|| {
            let mut ids: Vec<u128> = t.aggregates.iter().map(|(_, id)| id.as_u128()).collect();
            ids.sort_unstable();
            ids
        })
    }

    #[tokio::test]
    async fn later_work_waits_for_the_work_before_and_runs_only_after_it_ended_clean() {
        let successions = Successions::default();
        let (first, second) = (ClaimToken::new(1), ClaimToken::new(2));
        let holding = successions.hold(first, [("t", id(1)), ("t", id(2)), ("t", id(3))]);
        let (take_over, gate) = successions.take_over(Duration::from_secs(60));
        assert_eq!(take_over.len(), 1);
        assert_eq!(
            named(&take_over, first),
            None,
            "one claim, all clean: whole"
        );
        let later = successions.hold(second, [("t", id(1))]);
        let (take_over, _) = successions.take_over(Duration::from_secs(60));
        assert_eq!(
            named(&take_over, first),
            Some(vec![2, 3]),
            "not aggregate 1, which a claim already waits for: {take_over:?}"
        );
        assert!(
            take_over.iter().all(|t| t.claim != second),
            "nor the claim waiting for it: {take_over:?}"
        );

        assert!(gate.holds(("t", Uuid::from_u128(1))));
        assert!(!gate.holds(("t", Uuid::from_u128(4))));
        assert!(!gate.holds(("u", Uuid::from_u128(1))), "another type");
        assert!(gate.gives_back(("t", Uuid::from_u128(1))), "not ended yet");
        successions.settled(first, [("t", id(1)), ("t", id(2))].into_iter(), |a| {
            a == ("t", id(1))
        });
        let (take_over, gate_after) = successions.take_over(Duration::from_secs(60));
        assert_eq!(named(&take_over, first), Some(vec![3]), "2 ended unclean");
        assert!(!gate_after.holds(("t", Uuid::from_u128(1))), "held twice");
        assert!(
            gate_after.waits_on_calls(("t", Uuid::from_u128(3))),
            "still running"
        );
        assert!(
            !gate_after.holds(("t", Uuid::from_u128(2))),
            "ended unclean"
        );
        assert!(
            gate.waits_on_calls(("t", Uuid::from_u128(1))),
            "running when the first gate was made"
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
        assert!(gate.gives_back(("t", Uuid::from_u128(3))));
        drop(later);
        let (take_over, _) = successions.take_over(Duration::from_secs(60));
        assert!(take_over.is_empty());

        // Aggregate 2 ended unclean: it is not taken over until a batch of it ends clean.
        let third = ClaimToken::new(3);
        let _third = successions.hold(third, [("t", id(2)), ("t", id(5))]);
        let (take_over, gate) = successions.take_over(Duration::from_secs(60));
        assert!(!gate.holds(("t", id(2))), "troubled");
        assert!(gate.holds(("t", id(5))));
        assert_eq!(named(&take_over, third), Some(vec![5]), "not whole");
        successions.recorded(third, &[agg(2)]);
        let _fourth = successions.hold(ClaimToken::new(4), [("t", id(2))]);
        let (_, gate) = successions.take_over(Duration::from_secs(60));
        assert!(gate.holds(("t", id(2))), "clean again");
    }

    #[tokio::test]
    async fn a_claim_taken_over_whole_gates_each_of_its_aggregates_until_it_ends() {
        let successions = Successions::default();
        let first = ClaimToken::new(1);
        let holding = successions.hold(first, [("t", id(1)), ("u", id(1)), ("t", id(2))]);
        let (take_over, gate) = successions.take_over(Duration::from_secs(60));
        assert_eq!(take_over, vec![TakeOver::whole(first)]);
        assert!(gate.holds(("t", id(1))) && gate.holds(("u", id(1))));
        assert!(!gate.holds(("v", id(1))) && !gate.holds(("t", id(3))));
        // Recorded clean in parts: each aggregate is let go when its own record is applied.
        successions.settled(first, [("t", id(1)), ("u", id(1))].into_iter(), |_| true);
        successions.recorded(first, &[agg(1)]);
        assert!(gate.wait(("t", id(1))).await);
        assert!(!gate.gives_back(("t", id(1))));
        assert!(
            gate.gives_back(("u", id(1))),
            "its record is not applied yet"
        );
        assert!(
            gate.waits_on_calls(("u", id(1))),
            "its calls were running when the claim was taken over"
        );
        let (_, gate_after) = successions.take_over(Duration::from_secs(60));
        assert!(
            !gate_after.waits_on_calls(("u", id(1))),
            "its calls are over"
        );
        assert!(gate.waits_on_calls(("t", id(2))));
        let (take_over, _) = successions.take_over(Duration::from_secs(60));
        assert_eq!(
            take_over,
            vec![TakeOver::whole(first)],
            "what is under way is still taken over whole"
        );
        drop(holding);
        assert!(
            !gate.wait(("u", id(1))).await,
            "ended with the claim, unrecorded"
        );
        assert!(gate.wait(("t", id(1))).await, "recorded before");
    }

    #[tokio::test(start_paused = true)]
    async fn a_key_waits_for_the_work_before_at_most_its_bound() {
        let successions = Successions::default();
        let _holding = successions.hold(ClaimToken::new(1), [("t", id(1))]);
        let (_, gate) = successions.take_over(Duration::from_secs(8));
        assert!(!gate.wait(("t", Uuid::from_u128(1))).await);
    }
}
