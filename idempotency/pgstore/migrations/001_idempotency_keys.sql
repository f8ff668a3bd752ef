-- Ferry idempotency keys (idempotency/pgstore). One row per key:
--   a live claim:  done = false, token = the holder's owner token, expires_at = the end of its lease;
--   a completion:  done = true,  token = '',                       expires_at = the end of its retention.
-- A row whose expires_at has passed counts as absent; Cleanup deletes it.
--
-- key_hash is the SHA-256 of the namespaced key, not the key: keys are arbitrary bytes (a Kafka
-- key may hold NUL or invalid UTF-8, which a text column refuses) of any length (a bytea key
-- longer than about 2.7 kB would not fit in an index entry). The hash takes any key, is 32 bytes
-- for every key, and keeps the primary key small.
--
-- The only index is the primary key: completing a key rewrites its row, and with no index on the
-- columns it changes (and room left in each page by the fillfactor) that is a heap-only update,
-- which keeps the claim+complete cycle close to two plain statements. The price is that Cleanup
-- scans the table; run it hourly or daily, not every second.
--
-- The table name is the default of pgstore.WithTable; pgstore.SQL renders this file for another name.
CREATE TABLE IF NOT EXISTS ferry_idempotency_keys (
    key_hash   bytea       PRIMARY KEY,
    token      text        NOT NULL,
    done       boolean     NOT NULL DEFAULT false,
    expires_at timestamptz NOT NULL
) WITH (fillfactor = 80);
