-- Ferry idempotency keys (idempotency/pgstore). One row per key:
--   a live claim:  done = false, token = the holder's owner token, expires_at = the end of its lease;
--   a completion:  done = true,  token = '',                       expires_at = the end of its retention.
-- A row whose expires_at has passed counts as absent; Cleanup deletes it.
-- The table name is the default of pgstore.WithTable; pgstore.SQL renders this file for another name.
CREATE TABLE IF NOT EXISTS ferry_idempotency_keys (
    key        text        PRIMARY KEY,
    token      text        NOT NULL,
    done       boolean     NOT NULL DEFAULT false,
    expires_at timestamptz NOT NULL
);

CREATE INDEX IF NOT EXISTS ferry_idempotency_keys_expires_at_idx
    ON ferry_idempotency_keys (expires_at);
