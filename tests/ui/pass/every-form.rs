//! Every attribute the derive accepts, spread over several `#[outbox(...)]` attributes.

use outbox_core::{AggregateId, OutboxEvent};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use time::OffsetDateTime;
use time::macros::datetime;
use uuid::Uuid;

#[derive(Debug, PartialEq, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "license", event_type = "licensing.LicenseUpgraded")]
#[outbox(version = 3u32)]
#[outbox(upcast(from = 2, with = steps::v2_to_v3), upcast(with = v1_to_v2, from = 1))]
pub struct LicenseUpgraded {
    #[outbox(aggregate_id)]
    license_id: Uuid,
    tier: String,
    #[outbox(occurred_at)]
    #[serde(with = "time::serde::rfc3339")]
    upgraded_at: OffsetDateTime,
}

fn v1_to_v2(data: Value) -> Result<Value, &'static str> {
    Ok(data)
}

mod steps {
    use serde_json::Value;

    #[derive(Debug)]
    pub struct StepError;

    impl std::fmt::Display for StepError {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("no tier")
        }
    }

    impl std::error::Error for StepError {}

    pub fn v2_to_v3(mut data: Value) -> Result<Value, StepError> {
        let tier = data["plan"].take();
        if tier.is_null() {
            return Err(StepError);
        }
        data["tier"] = tier;
        Ok(data)
    }
}

/// A newtype aggregate id and an optional timestamp.
#[derive(Clone, Copy, Serialize, Deserialize)]
struct BotId(Uuid);

impl AggregateId for BotId {
    fn to_uuid(&self) -> Uuid {
        self.0
    }
}

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "bot")]
struct BotKicked {
    #[outbox(occurred_at)]
    #[serde(with = "time::serde::rfc3339::option")]
    kicked_at: Option<OffsetDateTime>,
    #[outbox(aggregate_id)]
    bot: BotId,
}

/// A generic event: the impl carries the struct's generics and where-clause, which must give
/// what `OutboxEvent` needs of the whole struct.
#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "bot", event_type = "BotNote")]
#[serde(bound = "T: Serialize + serde::de::DeserializeOwned")]
struct BotNote<T>
where
    T: Serialize + serde::de::DeserializeOwned + Send + Sync + 'static,
{
    #[outbox(aggregate_id)]
    bot_id: Uuid,
    note: T,
}

fn main() {
    assert_eq!(LicenseUpgraded::EVENT_TYPE, "licensing.LicenseUpgraded");
    assert_eq!(LicenseUpgraded::VERSION, 3);
    let froms: Vec<u32> = LicenseUpgraded::UPCASTERS.iter().map(|u| u.from()).collect();
    assert_eq!(froms, [1, 2]);

    let at = datetime!(2026-12-02 10:00 UTC);
    let v1 = json!({
        "version": 1,
        "data": {"license_id": Uuid::nil(), "plan": "pro", "upgraded_at": "2026-12-02T10:00:00Z"},
    });
    let decoded = outbox_core::decode::<LicenseUpgraded>(v1.to_string()).unwrap();
    assert_eq!(decoded.event.tier, "pro");
    assert_eq!(decoded.event.occurred_at(), Some(at));

    let kicked = BotKicked { kicked_at: None, bot: BotId(Uuid::from_u128(3)) };
    assert_eq!(kicked.aggregate_id(), Uuid::from_u128(3));
    assert_eq!(kicked.occurred_at(), None);

    let note = BotNote { bot_id: Uuid::nil(), note: 5_u8 };
    assert_eq!(note.aggregate_id(), Uuid::nil());
    assert_eq!(<BotNote<u8>>::EVENT_TYPE, "BotNote");
}
