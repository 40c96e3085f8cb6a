//! The lease of the batch in progress: what the relay can show it still holds, and the
//! heartbeat that renews it while handlers run.

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use crate::store::{ClaimToken, Store};
use crate::telemetry::{self, store_operation};

/// A batch's claim as this relay knows it.
///
/// The deadline is measured on this relay's clock from the moment it *sent* the claim (or the
/// last renewal that succeeded), which is no later than the moment the store granted it: the
/// relay's view of its lease never outlasts the store's.
pub(super) struct Lease {
    token: ClaimToken,
    length: Duration,
    /// When the claim ends unless renewed, on this relay's clock.
    deadline: Mutex<Instant>,
    /// The store said the claim is gone.
    lost: AtomicBool,
}

impl Lease {
    /// The lease of a claim of `length` whose request was sent at `sent`.
    pub(super) fn new(token: ClaimToken, length: Duration, sent: Instant) -> Self {
        Self {
            token,
            length,
            deadline: Mutex::new(sent + length),
            lost: AtomicBool::new(false),
        }
    }

    pub(super) fn token(&self) -> ClaimToken {
        self.token
    }

    /// Whether the store said the claim is gone.
    pub(super) fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Relaxed)
    }

    fn deadline(&self) -> Instant {
        *self.deadline.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether a handler that may take up to `timeout` can start: the claim is not known to be
    /// lost, and it lasts longer than that from now, even if no renewal succeeds meanwhile.
    pub(super) fn can_start(&self, timeout: Duration) -> bool {
        !self.is_lost() && Instant::now() + timeout < self.deadline()
    }

    /// Renews the claim every quarter of its length until it is lost; never returns otherwise.
    /// Run beside the batch's handlers and dropped when they are done.
    pub(super) async fn keep<S: Store>(&self, store: &S) -> Infallible {
        let mut last_sent = self.deadline() - self.length;
        let mut retry = Duration::from_millis(50);
        loop {
            tokio::time::sleep_until(last_sent + self.length / 4).await;
            let mut lost_connections = 0;
            loop {
                let sent = Instant::now();
                match store.renew(self.token, self.length).await {
                    Ok(true) => {
                        *self.deadline.lock().unwrap_or_else(PoisonError::into_inner) =
                            sent + self.length;
                        last_sent = sent;
                        retry = Duration::from_millis(50);
                        break;
                    }
                    Ok(false) => {
                        self.lost.store(true, Ordering::Relaxed);
                        telemetry::claim_lost();
                        tracing::warn!(
                            claim = %self.token,
                            "outbox relay lost the claim of its batch (it expired, and another \
                             relay may hold its work): no more handlers start for it and its \
                             outcomes are dropped"
                        );
                        return std::future::pending().await;
                    }
                    Err(error) => {
                        telemetry::store_error(store_operation::RENEW);
                        tracing::warn!(
                            %error,
                            claim = %self.token,
                            "outbox relay cannot renew the claim of its batch; retrying"
                        );
                        // A broken connection is replaced at once; anything else waits a little.
                        if error.is_connection_lost()
                            && lost_connections < super::LOST_CONNECTIONS_RETRIED_AT_ONCE
                        {
                            lost_connections += 1;
                        } else {
                            tokio::time::sleep(retry).await;
                            retry = (retry * 2).min(self.length / 8);
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_handler_starts_only_while_the_claim_outlasts_its_timeout() {
        let lease = Lease::new(ClaimToken::new(1), Duration::from_secs(8), Instant::now());
        assert!(lease.can_start(Duration::from_secs(3)));
        tokio::time::advance(Duration::from_secs(4)).await;
        assert!(lease.can_start(Duration::from_secs(3)));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(
            !lease.can_start(Duration::from_secs(3)),
            "5 s into an 8 s lease, a 3 s handler could outlive the claim"
        );
        lease.lost.store(true, Ordering::Relaxed);
        assert!(!lease.can_start(Duration::ZERO));
    }
}
