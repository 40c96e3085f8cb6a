//! Claiming ahead: while a batch's handlers, not the store, are what the relay waits for, the
//! next batch is claimed before the batch's last calls end, so that it is ready when they do.
//!
//! A batch's calls report their progress here. When the batch has run at least as long as a
//! claim takes (its handlers are slower than the store) and, at its pace so far, what is left
//! of it takes no longer than two claims (a claim made while handlers run takes longer than
//! the last one measured), the next claim starts. With handlers that are quick
//! beside the claim, it never does: the relay then claims after the batch, as the claim is its
//! critical path and a second one in flight would only compete with it for the server.
//!
//! The claim ahead is an ordinary claim: it leaves out every aggregate of the batch still
//! running (a live claim holds them), as it would for another relay, so order per key holds.
//! So the batch claimed ahead may start beside the last calls of the batch before: once it is
//! claimed and planned ([`Progress::next_claimed`]) and a call slot is idle, the batch before
//! splits off (see `batch.rs`).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::{Notify, watch};
use tokio::time::Instant;

/// Where a batch is, for the claim ahead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Running,
    /// The next batch should be claimed now.
    ClaimNext,
    /// Every call of the batch is done.
    Over,
}

/// The progress of one batch's handler calls.
pub(super) struct Progress {
    started: Instant,
    /// How long a claim takes; `None`: do not claim ahead.
    claim_takes: Option<Duration>,
    calls: AtomicUsize,
    finished: AtomicUsize,
    phase: watch::Sender<Phase>,
    /// The next batch is claimed and waits for this one: call slots this batch leaves idle
    /// should go to it.
    next_claimed: AtomicBool,
    next_claimed_told: Notify,
}

impl Progress {
    /// The progress of a batch starting now, when a claim takes about `claim_takes` (`None`:
    /// never claim ahead of this batch).
    pub(super) fn new(claim_takes: Option<Duration>) -> Self {
        Self {
            started: Instant::now(),
            claim_takes,
            calls: AtomicUsize::new(0),
            finished: AtomicUsize::new(0),
            phase: watch::Sender::new(Phase::Running),
            next_claimed: AtomicBool::new(false),
            next_claimed_told: Notify::new(),
        }
    }

    /// The next batch is claimed: it waits for this one.
    pub(super) fn next_claimed(&self) {
        self.next_claimed.store(true, Ordering::Relaxed);
        self.next_claimed_told.notify_one();
    }

    /// Whether the next batch is claimed.
    pub(super) fn is_next_claimed(&self) -> bool {
        self.next_claimed.load(Ordering::Relaxed)
    }

    /// Waits until told that the next batch is claimed (at once if told before).
    pub(super) async fn next_claimed_told(&self) {
        self.next_claimed_told.notified().await;
    }

    /// How many of the batch's planned calls are done.
    pub(super) fn finished(&self) -> usize {
        self.finished.load(Ordering::Relaxed)
    }

    /// The batch plans `calls` handler calls.
    pub(super) fn planned(&self, calls: usize) {
        self.calls.store(calls, Ordering::Relaxed);
    }

    /// One planned call is done (made, or not made).
    pub(super) fn finished_one(&self) {
        let finished = self.finished.fetch_add(1, Ordering::Relaxed) + 1;
        let Some(claim_takes) = self.claim_takes else {
            return;
        };
        if *self.phase.borrow() == Phase::Running
            && claim_now(
                self.started.elapsed(),
                claim_takes,
                finished,
                self.calls.load(Ordering::Relaxed),
            )
        {
            self.phase.send_replace(Phase::ClaimNext);
        }
    }

    /// The batch is done.
    pub(super) fn over(&self) {
        self.phase.send_replace(Phase::Over);
    }

    /// Waits until the next batch should be claimed (true), or the batch is over first (false).
    pub(super) async fn claim_next(&self) -> bool {
        let mut phase = self.phase.subscribe();
        // The sender lives as long as `self`: the wait ends only by the phase.
        matches!(
            phase
                .wait_for(|phase| *phase != Phase::Running)
                .await
                .as_deref(),
            Ok(Phase::ClaimNext)
        )
    }

    /// Waits until the batch is over.
    pub(super) async fn wait_over(&self) {
        let mut phase = self.phase.subscribe();
        let _ = phase.wait_for(|phase| *phase == Phase::Over).await;
    }
}

/// Whether to claim the next batch now: `finished` of `calls` are done after `elapsed`; a claim
/// takes `claim_takes`. Now, when the batch has run at least as long as a claim (its handlers,
/// not the store, are the wait) and, at its pace so far, the rest takes no longer than two.
fn claim_now(elapsed: Duration, claim_takes: Duration, finished: usize, calls: usize) -> bool {
    if finished == 0 || finished >= calls || elapsed < claim_takes {
        return false;
    }
    let left = elapsed.as_secs_f64() * (calls - finished) as f64 / finished as f64;
    left <= 2.0 * claim_takes.as_secs_f64()
}

/// Whether the claims after a batch ask for less ([`RelayConfig::claim_size`]): its calls took
/// `took` (until it ended, or split; `None` when it split before any of its calls ended), its
/// claim `claim_takes`; `was`: whether its own claim asked for less; `deliveries`: it had
/// deliveries to record (retries, failures: each failure makes the later events of its key in
/// the batch rows of their own).
///
/// Less when its calls took longer than its claim (the handlers, not the store, are what the
/// relay waits for) or it had deliveries; the whole batch again only when its calls took less
/// than half its claim. In between, and after a batch that split before any call ended (its
/// keys waiting for the batch before, or for retries), as before: a batch of slow handlers
/// about as long as its claim (a relay's first claim is slow) must not make the next claim take
/// every aggregate of the backlog, which leaves the claims after it nothing to claim ahead.
///
/// [`RelayConfig::claim_size`]: crate::RelayConfig
pub(super) fn claim_less(
    was: bool,
    took: Option<Duration>,
    claim_takes: Duration,
    deliveries: bool,
) -> bool {
    match took {
        _ if deliveries => true,
        Some(took) if took > claim_takes => true,
        Some(took) => was && took * 2 >= claim_takes,
        None => was,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn the_next_claim_starts_when_what_is_left_takes_about_a_claim() {
        // 1 500 calls of 2 ms at 128 at once, claims of 5 ms: about 25 ms in all.
        assert!(!claim_now(5 * MS, 5 * MS, 300, 1500), "20 ms are left");
        assert!(!claim_now(14 * MS, 5 * MS, 840, 1500), "11 ms are left");
        assert!(
            claim_now(15 * MS, 5 * MS, 900, 1500),
            "10 ms are left: two claims"
        );
        assert!(claim_now(24 * MS, 5 * MS, 1440, 1500));
    }

    #[test]
    fn handlers_quicker_than_the_claim_never_claim_ahead() {
        // The batch's calls take 2 ms in all; the claim 5.
        assert!(!claim_now(MS, 5 * MS, 750, 1500));
        assert!(!claim_now(2 * MS, 5 * MS, 1499, 1500));
    }

    #[test]
    fn nothing_to_go_by_claims_nothing() {
        assert!(!claim_now(10 * MS, 5 * MS, 0, 1500), "no call finished yet");
        assert!(
            !claim_now(10 * MS, 5 * MS, 3, 3),
            "every call is done: the batch is over"
        );
        assert!(!claim_now(10 * MS, 5 * MS, 0, 0), "a batch without calls");
    }

    #[test]
    fn slow_handlers_or_deliveries_make_the_claims_smaller() {
        assert!(claim_less(false, Some(30 * MS), 20 * MS, false));
        assert!(claim_less(false, Some(MS), 20 * MS, true), "deliveries");
        assert!(claim_less(false, None, 20 * MS, true));
    }

    #[test]
    fn only_handlers_clearly_quicker_than_the_claim_make_them_whole_again() {
        assert!(!claim_less(true, Some(9 * MS), 20 * MS, false));
        // A first claim slower than the batch it claimed: the handlers are not quick.
        assert!(claim_less(true, Some(28 * MS), 30 * MS, false));
        assert!(claim_less(true, Some(10 * MS), 20 * MS, false));
        // Whole claims stay whole while the calls are no slower than the claim.
        assert!(!claim_less(false, Some(20 * MS), 20 * MS, false));
        assert!(!claim_less(false, Some(MS), 20 * MS, false));
    }

    #[test]
    fn a_batch_split_before_any_call_ended_leaves_the_claim_size_as_it_was() {
        assert!(claim_less(true, None, 20 * MS, false));
        assert!(!claim_less(false, None, 20 * MS, false));
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_over_before_its_claim_was_due_claims_nothing_ahead() {
        let progress = Progress::new(Some(5 * MS));
        progress.planned(2);
        let waiting = progress.claim_next();
        progress.finished_one();
        progress.finished_one();
        progress.over();
        assert!(!waiting.await);
        progress.wait_over().await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_batch_near_its_end_claims_ahead() {
        // Ten calls 10 ms apart; a claim takes 20 ms.
        let progress = Progress::new(Some(20 * MS));
        progress.planned(10);
        let (claim, ()) = tokio::join!(progress.claim_next(), async {
            for finished in 1..=9 {
                tokio::time::advance(10 * MS).await;
                progress.finished_one();
                let expected = if finished < 6 {
                    Phase::Running
                } else {
                    // 60 ms for 6 calls: the last 4 take 40 ms, two claims.
                    Phase::ClaimNext
                };
                assert_eq!(*progress.phase.borrow(), expected, "after {finished} calls");
                tokio::task::yield_now().await;
            }
            progress.finished_one();
            progress.over();
        });
        assert!(claim);
    }

    #[tokio::test(start_paused = true)]
    async fn a_relay_that_does_not_know_how_long_a_claim_takes_does_not_claim_ahead() {
        let progress = Progress::new(None);
        progress.planned(10);
        let (claim, ()) = tokio::join!(progress.claim_next(), async {
            for _ in 0..10 {
                tokio::time::advance(Duration::from_secs(1)).await;
                progress.finished_one();
            }
            progress.over();
        });
        assert!(!claim);
    }
}
