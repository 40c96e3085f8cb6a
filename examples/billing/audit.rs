//! Audit: records every event, as stored, exactly once: a plain insert, in the transaction that
//! records the delivery (`Outbox::handle_once`). The seed relied on `UNIQUE (outbox_event_id)`
//! and `ON CONFLICT DO NOTHING`; the key stays, as a check that would fail loudly.

use outbox_core::{Delivery, HandlerError, Observer};
use uuid::Uuid;

use super::db::DbOutbox;
use super::story;
use crate::args;

/// The audit observer: it takes every event of the catalog, undecoded.
#[derive(Debug, Clone)]
pub struct Audit(pub DbOutbox);

impl Observer for Audit {
    const NAME: &'static str = "audit";

    async fn observe(&self, d: &Delivery<'_>) -> Result<(), HandlerError> {
        let e = d.event();
        self.0
            .exec_once(
                d,
                "INSERT INTO audit_log VALUES ($1, $2, $3, $4, $5, $6)",
                args![
                    Uuid::new_v4(),
                    e.id,
                    e.aggregate_type.clone(),
                    e.aggregate_id,
                    e.event_type.clone(),
                    e.payload.clone()
                ],
                None,
            )
            .await?;
        story::handled(
            d,
            format!(
                "recorded {} of {} {}",
                e.event_type,
                e.aggregate_type,
                story::short(e.aggregate_id)
            ),
        );
        Ok(())
    }
}
