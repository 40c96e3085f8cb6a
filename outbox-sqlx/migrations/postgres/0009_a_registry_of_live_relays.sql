-- The relays at work and what each one's build routes (JSON), so that relays of different
-- builds (a rolling deploy) leave each other the work only the other can do and fan events out
-- to every build's subscribers. A relay renews its row while it runs (`seen_at`); rows not
-- renewed within a while are deleted by the next registration. `generation` changes only when a
-- relay registers anew: the registry's version is the list of generations.
CREATE TABLE {relays} (
    id UUID PRIMARY KEY,
    generation BIGINT GENERATED ALWAYS AS IDENTITY,
    routing TEXT NOT NULL,
    registered_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    seen_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
