-- Ferry idempotency keys (idempotency/sqlitestore). One row per key:
--   a live claim:  done = 0, token = the holder's owner token, expires_at = the end of its lease;
--   a completion:  done = 1, token = '',                       expires_at = the end of its retention.
-- expires_at is in Unix milliseconds. A row whose expires_at has passed counts as absent;
-- Cleanup deletes it, scanning the table: the only index is the primary key, so that claiming
-- and completing a key write one b-tree, not two.
-- key_hash is the SHA-256 of the namespaced key, not the key: keys are arbitrary bytes of any
-- length, and the hash keeps every key of the primary key at 32 bytes.
-- The table name is the default of sqlitestore.WithTable; sqlitestore.SQL renders this file
-- for another name.
CREATE TABLE IF NOT EXISTS ferry_idempotency_keys (
    key_hash   BLOB    NOT NULL PRIMARY KEY,
    token      TEXT    NOT NULL,
    done       INTEGER NOT NULL DEFAULT 0,
    expires_at INTEGER NOT NULL
) WITHOUT ROWID;
