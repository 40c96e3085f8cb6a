//! Schema and table names, validated as plain SQL identifiers before they go into any SQL.

use outbox_core::ConfigError;

/// Where the outbox tables live: a schema and a base table name.
///
/// The events go in `<schema>.<table>`, per-subscriber deliveries in
/// `<schema>.<table>_deliveries`, and applied migrations in `<schema>.<table>_migrations`. The
/// default is the seed's `events.outbox`. SQLite has no schemas: there the tables are `<table>`,
/// `<table>_deliveries` and `<table>_migrations`, and the schema is not used. On MySQL the
/// tables are likewise `<table>...`, in the database the connection names.
///
/// Names are checked here, once: only lowercase ASCII letters, digits and underscores, starting
/// with a letter or an underscore, so that they can be spliced into SQL safely (they are quoted
/// too).
///
/// ```
/// use outbox_sqlx::TableNames;
///
/// let names = TableNames::new("billing", "outbox")?;
/// assert_eq!(names.schema(), "billing");
/// assert!(TableNames::new("billing; DROP TABLE users", "outbox").is_err());
/// # Ok::<(), outbox_core::ConfigError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableNames {
    schema: String,
    table: String,
}

/// The indexes the migrations create, named `<table>_<index>`.
const INDEXES: [&str; 19] = [
    "pending_idx",
    "published_idx",
    "aggregate_idx",
    "stalled_idx",
    "parked_idx",
    "held_by_idx",
    "held_behind_idx",
    "claim_idx",
    "deliveries_head_idx",
    "deliveries_aggregate_idx",
    "deliveries_due_idx",
    "deliveries_event_idx",
    "deliveries_claim_idx",
    "inbox_handled_idx",
    "waiting_idx",
    "claim_parts_idx",
    // Not indexes: PostgreSQL's trigger (and its function) that counts events put back, the
    // function that draws an event's id, and the one that holds a claim.
    "put_back",
    "next_id",
    "hold_claim",
];

/// PostgreSQL truncates identifiers to 63 bytes.
const MAX_IDENTIFIER: usize = 63;
/// The longest suffix added to the table name, in `<table>_deliveries_aggregate_idx`.
const LONGEST_SUFFIX: &str = "_deliveries_aggregate_idx";

impl Default for TableNames {
    fn default() -> Self {
        Self {
            schema: "events".to_owned(),
            table: "outbox".to_owned(),
        }
    }
}

impl TableNames {
    /// Names in `schema`, based on `table`.
    pub fn new(schema: &str, table: &str) -> Result<Self, ConfigError> {
        Ok(Self {
            schema: identifier("schema", schema, MAX_IDENTIFIER)?,
            table: identifier("table", table, MAX_IDENTIFIER - LONGEST_SUFFIX.len())?,
        })
    }

    /// The schema.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// The base table name (the events table).
    pub fn table(&self) -> &str {
        &self.table
    }

    /// `"schema"."table<suffix>"`, quoted.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn qualified(&self, suffix: &str) -> String {
        format!("\"{}\".\"{}{suffix}\"", self.schema, self.table)
    }

    /// `"table<suffix>"`, quoted, for names that live in the schema implicitly (indexes).
    #[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
    pub(crate) fn local(&self, suffix: &str) -> String {
        format!("\"{}{suffix}\"", self.table)
    }

    /// `` `table<suffix>` ``, quoted as MySQL quotes names whatever its SQL mode.
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    pub(crate) fn backticked(&self, suffix: &str) -> String {
        format!("`{}{suffix}`", self.table)
    }

    /// `"schema"`, quoted.
    pub(crate) fn quoted_schema(&self) -> String {
        format!("\"{}\"", self.schema)
    }

    /// A migration template with `{outbox}`, `{deliveries}` and `{claims}` replaced by
    /// `table(suffix)` (the quoted table `<table><suffix>`, qualified or not as the database
    /// wants) and each index placeholder, such as `{pending_idx}`, by `index("_<index>")`.
    pub(crate) fn render(
        &self,
        template: &str,
        table: impl Fn(&str) -> String,
        index: impl Fn(&str) -> String,
    ) -> String {
        let mut text = template
            .replace("{outbox}", &table(""))
            .replace("{deliveries_rebuilt}", &table("_deliveries_rebuilt"))
            .replace("{deliveries}", &table("_deliveries"))
            .replace("{claim_parts}", &table("_claim_parts"))
            .replace("{claims}", &table("_claims"))
            .replace("{holds}", &table("_holds"))
            .replace("{schema}", &self.quoted_schema())
            .replace("{skips}", &table("_skips"))
            .replace("{inbox}", &table("_inbox"))
            .replace("{relays}", &table("_relays"))
            .replace("{requeues}", &table("_requeues"))
            .replace("{released}", &table("_released"))
            .replace("{id_seq}", &table("_id_seq"))
            .replace("{claim_lock}", &table("_claim_lock"))
            .replace("{aggregate_locks}", &table("_aggregate_locks"));
        for name in INDEXES {
            text = text.replace(&format!("{{{name}}}"), &index(&format!("_{name}")));
        }
        text
    }

    /// A number that identifies these tables, for advisory locks.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn lock_namespace(&self) -> i32 {
        // FNV-1a: stable across builds and platforms, unlike std's hasher.
        let mut hash: u32 = 0x811c_9dc5;
        for byte in self.schema.bytes().chain([b'.']).chain(self.table.bytes()) {
            hash ^= u32::from(byte);
            hash = hash.wrapping_mul(0x0100_0193);
        }
        i32::from_ne_bytes(hash.to_ne_bytes())
    }
}

fn identifier(role: &'static str, value: &str, max_len: usize) -> Result<String, ConfigError> {
    let mut chars = value.chars();
    let valid_start = chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
    let valid_rest = chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if valid_start && valid_rest && value.len() <= max_len {
        Ok(value.to_owned())
    } else {
        Err(ConfigError::InvalidIdentifier {
            role,
            value: value.to_owned(),
            max_len,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_names_are_accepted() {
        let names = TableNames::new("events", "outbox_v2").unwrap();
        assert_eq!(
            names.qualified("_deliveries"),
            "\"events\".\"outbox_v2_deliveries\""
        );
        assert_eq!(names.local("_pending_idx"), "\"outbox_v2_pending_idx\"");
        TableNames::new("_private", "x").unwrap();
        TableNames::new(&"s".repeat(63), &"t".repeat(38)).unwrap();
    }

    #[test]
    fn injection_attempts_and_odd_names_are_rejected_with_a_clear_error() {
        for (schema, table) in [
            ("events\"; DROP TABLE users; --", "outbox"),
            ("events", "outbox; DELETE FROM outbox"),
            ("events", "out\"box"),
            ("Events", "outbox"),
            ("events", "1outbox"),
            ("", "outbox"),
            ("events", ""),
            ("evénts", "outbox"),
            ("events", "out box"),
            ("events.x", "outbox"),
            (&"s".repeat(64), "outbox"),
            ("events", &"t".repeat(39)),
        ] {
            let error = TableNames::new(schema, table).unwrap_err();
            assert!(
                matches!(error, ConfigError::InvalidIdentifier { .. }),
                "{schema:?}.{table:?}: {error:?}"
            );
        }
        let error = TableNames::new("events", "outbox; DELETE FROM outbox").unwrap_err();
        assert_eq!(
            error.to_string(),
            "invalid SQL identifier \"outbox; DELETE FROM outbox\" for the table: use 1 to 38 \
             lowercase ASCII letters, digits and underscores, starting with a letter or an \
             underscore"
        );
    }

    #[test]
    fn lock_namespace_differs_between_tables_and_is_stable() {
        let a = TableNames::new("events", "outbox").unwrap();
        let b = TableNames::new("events", "outbox2").unwrap();
        assert_ne!(a.lock_namespace(), b.lock_namespace());
        assert_eq!(a.lock_namespace(), TableNames::default().lock_namespace());
        // Pinned: changing the hash would let old and new builds lock different keys.
        assert_eq!(a.lock_namespace(), -751_276_897);
    }
}
