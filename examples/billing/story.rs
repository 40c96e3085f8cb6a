//! What the example prints, so that its output tells what happened.

use outbox_core::Delivery;
use time::OffsetDateTime;
use uuid::Uuid;

/// A step of the scenario.
pub fn step(text: &str) {
    println!("\n{text}");
}

/// A detail of a step.
pub fn note(text: &str) {
    println!("  {text}");
}

/// A subscriber handled an event.
pub fn handled(delivery: &Delivery<'_>, what: impl std::fmt::Display) {
    let retry = if delivery.attempt() > 1 {
        format!(" (attempt {})", delivery.attempt())
    } else {
        String::new()
    };
    println!(
        "    {:<13} #{:<2} {:<20} {what}{retry}",
        delivery.subscriber(),
        delivery.event().id,
        delivery.event().event_type
    );
}

/// The last four hex digits of an id: enough to tell the example's ids apart.
pub fn short(id: Uuid) -> String {
    let hex = id.simple().to_string();
    hex[hex.len() - 4..].to_owned()
}

/// A Unix time as a date.
pub fn date(unix: i64) -> String {
    OffsetDateTime::from_unix_timestamp(unix)
        .map(|t| t.date().to_string())
        .unwrap_or_else(|_| unix.to_string())
}
