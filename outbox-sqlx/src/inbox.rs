//! The inbox: which messages a consumer already handled, recorded in the transaction of the
//! handling's effects.
//!
//! Messages that come from outside the outbox (a broker redelivering, a webhook sent twice) can
//! arrive more than once. [`OutboxTx::receive`](crate::OutboxTx::receive) records "`consumer`
//! handled `message_id`" in the caller's transaction and says whether it was recorded before:
//! the effects and the record commit together or not at all, so each message's effects happen
//! once per consumer, however often it arrives.

use crate::error::Error;

/// The longest consumer name, in bytes.
pub const MAX_CONSUMER_LEN: usize = 200;
/// The longest message id, in bytes.
pub const MAX_MESSAGE_ID_LEN: usize = 500;

/// Whether a consumer handles a message for the first time: what
/// [`OutboxTx::receive`](crate::OutboxTx::receive) returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a duplicate's effects must not be applied again"]
pub enum Received {
    /// Not handled before: apply its effects in this transaction, then commit.
    New,
    /// Handled before by a transaction that committed: skip its effects.
    Duplicate,
}

impl Received {
    /// Whether the message is new to the consumer.
    pub fn is_new(self) -> bool {
        self == Received::New
    }

    /// Whether the consumer handled the message before.
    pub fn is_duplicate(self) -> bool {
        self == Received::Duplicate
    }
}

/// Checks a consumer name and a message id before they reach the database.
pub(crate) fn check(consumer: &str, message_id: &str) -> Result<(), Error> {
    let invalid = |role: &'static str, value: &str, reason: String| Error::InvalidInboxKey {
        role,
        value: value.chars().take(80).collect(),
        reason,
    };
    if consumer.is_empty() {
        return Err(invalid("consumer", consumer, "it is empty".to_owned()));
    }
    if consumer.len() > MAX_CONSUMER_LEN {
        return Err(invalid(
            "consumer",
            consumer,
            format!(
                "it is {} bytes long, more than {MAX_CONSUMER_LEN}",
                consumer.len()
            ),
        ));
    }
    if consumer.chars().any(char::is_control) {
        return Err(invalid(
            "consumer",
            consumer,
            "it holds a control character".to_owned(),
        ));
    }
    if message_id.is_empty() {
        return Err(invalid("message id", message_id, "it is empty".to_owned()));
    }
    if message_id.len() > MAX_MESSAGE_ID_LEN {
        return Err(invalid(
            "message id",
            message_id,
            format!(
                "it is {} bytes long, more than {MAX_MESSAGE_ID_LEN}",
                message_id.len()
            ),
        ));
    }
    if message_id.contains('\0') {
        return Err(invalid(
            "message id",
            message_id,
            "it holds a NUL character, which a database text column cannot store".to_owned(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consumers_and_message_ids_are_checked_with_a_clear_error() {
        check("billing-webhooks", "evt_1NqX").unwrap();
        check(
            &"c".repeat(MAX_CONSUMER_LEN),
            &"m".repeat(MAX_MESSAGE_ID_LEN),
        )
        .unwrap();
        check("ünïcode consumer", "ünïcode id").unwrap();
        let cases = [
            ("", "1", "invalid inbox consumer \"\": it is empty"),
            ("c", "", "invalid inbox message id \"\": it is empty"),
            (
                "line\nbreak",
                "1",
                "invalid inbox consumer \"line\\nbreak\": it holds a control character",
            ),
            (
                "c",
                "a\0b",
                "invalid inbox message id \"a\\0b\": it holds a NUL character, which a \
                 database text column cannot store",
            ),
        ];
        for (consumer, id, message) in cases {
            assert_eq!(check(consumer, id).unwrap_err().to_string(), message);
        }
        let long = "c".repeat(MAX_CONSUMER_LEN + 1);
        assert_eq!(
            check(&long, "1").unwrap_err().to_string(),
            format!(
                "invalid inbox consumer {:?}: it is 201 bytes long, more than 200",
                "c".repeat(80)
            )
        );
        let long = "m".repeat(MAX_MESSAGE_ID_LEN + 1);
        assert!(
            check("c", &long)
                .unwrap_err()
                .to_string()
                .ends_with("it is 501 bytes long, more than 500")
        );
    }
}
