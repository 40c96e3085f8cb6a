//! When an idle relay looks again: the due times of the retries and parked events it recorded,
//! and the next one its store reported (`Batch::next_due`: recorded by another relay, or by
//! this one before it restarted, or the end of a live claim's lease, after which a dead
//! relay's work is free).
//!
//! Every due time is kept until it passes, not only the earliest: a relay that woke for the
//! earliest retry and claimed it alone (the next was not due yet) must still wake for the next,
//! not sleep until its poll interval.

use std::collections::BTreeSet;
use std::time::Duration;

use tokio::time::Instant;

use crate::store::{DeliveryOutcome, EventOutcome, Outcomes};

/// The due times of the retries and parked events a relay recorded, to the millisecond
/// (rounded up: a relay wakes at most a millisecond late). At most [`KEPT`], the earliest: a
/// retry beyond them is made at the relay's next poll, as without them.
#[derive(Debug)]
pub(super) struct DueTimes {
    base: Instant,
    /// Milliseconds after `base`.
    times: BTreeSet<u64>,
}

/// How many distinct due times a relay keeps.
const KEPT: usize = 4096;

impl Default for DueTimes {
    fn default() -> Self {
        Self {
            base: Instant::now(),
            times: BTreeSet::new(),
        }
    }
}

impl DueTimes {
    /// Notes when each retry and parked event of `outcomes`, just recorded, is due (counted
    /// from after the record, so never before the store's own time).
    pub(super) fn note(&mut self, outcomes: &Outcomes) {
        for due_in in due_in(outcomes) {
            self.note_in(due_in);
        }
    }

    /// Notes a due time `due_in` from now (a store's, read as it comes: never before the
    /// store's own time).
    pub(super) fn note_in(&mut self, due_in: Duration) {
        if let Some(at) = Instant::now().checked_add(due_in) {
            self.insert(at);
        }
    }

    fn insert(&mut self, at: Instant) {
        let after = at.saturating_duration_since(self.base);
        let ms = u64::try_from(after.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX);
        self.times.insert(ms);
        if self.times.len() > KEPT {
            self.times.pop_last();
        }
    }

    /// Takes in the due times of `other` (which is left empty).
    pub(super) fn absorb(&mut self, other: &mut Self) {
        for ms in std::mem::take(&mut other.times) {
            if let Some(at) = other.base.checked_add(Duration::from_millis(ms)) {
                self.insert(at);
            }
        }
    }

    /// Whether a due time has passed by `now`; those that have are forgotten (the claim after
    /// this takes what is due).
    pub(super) fn take_passed(&mut self, now: Instant) -> bool {
        let now =
            u64::try_from(now.saturating_duration_since(self.base).as_millis()).unwrap_or(u64::MAX);
        let later = match now.checked_add(1) {
            Some(after) => self.times.split_off(&after),
            None => BTreeSet::new(),
        };
        let passed = !self.times.is_empty();
        self.times = later;
        passed
    }

    /// The earliest due time to come.
    pub(super) fn next(&self) -> Option<Instant> {
        let ms = *self.times.first()?;
        self.base.checked_add(Duration::from_millis(ms))
    }
}

/// How soon each retry and parked event of `outcomes` is due.
fn due_in(outcomes: &Outcomes) -> impl Iterator<Item = Duration> + '_ {
    let events = outcomes
        .events
        .iter()
        .filter_map(|(_, outcome)| match outcome {
            EventOutcome::Parked { retry_in, .. } => Some(*retry_in),
            _ => None,
        });
    let deliveries = outcomes.deliveries.iter().filter_map(|d| match &d.outcome {
        DeliveryOutcome::Retry { retry_in, .. } => Some(*retry_in),
        _ => None,
    });
    events.chain(deliveries)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[tokio::test(start_paused = true)]
    async fn every_due_time_is_kept_until_it_passes_not_only_the_earliest() {
        let mut due = DueTimes::default();
        let start = Instant::now();
        due.insert(start + 300 * MS);
        due.insert(start + 150 * MS);
        due.insert(start + 150 * MS + Duration::from_micros(300));
        assert_eq!(due.next(), Some(start + 150 * MS));
        assert!(!due.take_passed(start + 149 * MS));

        tokio::time::advance(150 * MS).await;
        assert!(due.take_passed(Instant::now()), "150 ms passed");
        // (151: 150.3 ms rounded up.)
        assert_eq!(
            due.next(),
            Some(start + 151 * MS),
            "the next is still known"
        );
        assert!(!due.take_passed(Instant::now()));
        tokio::time::advance(MS).await;
        assert!(due.take_passed(Instant::now()));
        assert_eq!(due.next(), Some(start + 300 * MS));
        assert!(!due.take_passed(Instant::now()));

        tokio::time::advance(200 * MS).await;
        assert!(due.take_passed(Instant::now()));
        assert_eq!(due.next(), None);
        assert!(!due.take_passed(Instant::now()));
    }

    #[tokio::test(start_paused = true)]
    async fn a_due_time_a_store_reported_counts_from_when_it_is_read() {
        let mut due = DueTimes::default();
        tokio::time::advance(7 * MS).await;
        let read = Instant::now();
        due.note_in(40 * MS);
        assert_eq!(due.next(), Some(read + 40 * MS));
        assert!(!due.take_passed(read + 39 * MS));
        assert!(due.take_passed(read + 40 * MS));
        // (A store that says "due in 0": at once.)
        due.note_in(Duration::ZERO);
        assert!(due.take_passed(Instant::now()));
    }

    #[tokio::test(start_paused = true)]
    async fn due_times_of_another_list_are_taken_in_and_the_earliest_are_kept() {
        let mut due = DueTimes::default();
        let start = Instant::now();
        tokio::time::advance(10 * MS).await;
        let mut rests = DueTimes::default();
        rests.insert(start + 40 * MS);
        due.insert(start + 50 * MS);
        due.absorb(&mut rests);
        assert_eq!(rests.next(), None, "taken");
        assert_eq!(due.next(), Some(start + 40 * MS));

        let mut many = DueTimes::default();
        for n in 0..(KEPT as u64 + 10) {
            many.insert(start + Duration::from_secs(1) + Duration::from_millis(n));
        }
        assert_eq!(many.times.len(), KEPT);
        assert_eq!(many.next(), Some(start + Duration::from_secs(1)));
        many.insert(start + 20 * MS);
        assert_eq!(many.next(), Some(start + 20 * MS), "an earlier one is kept");
        assert_eq!(many.times.len(), KEPT);
    }
}
