-- The relays at work and what each one's build routes (JSON), so that relays of different
-- builds (a rolling deploy) leave each other the work only the other can do and fan events out
-- to every build's subscribers. A relay renews its row while it runs (`seen_at`, microseconds
-- since the epoch); rows not renewed within a while are deleted by the next registration.
-- `generation` changes only when a relay registers anew: the registry's version is the list of
-- generations.
CREATE TABLE {relays} (
    id TEXT PRIMARY KEY,
    generation INTEGER NOT NULL,
    routing TEXT NOT NULL,
    registered_at INTEGER NOT NULL,
    seen_at INTEGER NOT NULL
);
