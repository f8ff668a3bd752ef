-- Ferry transactional outbox, SQLite, version 1.
-- Events wait in ferry_outbox until a relay published them; id orders them.
-- Times are Unix microseconds (created_at, failed_at) or milliseconds
-- (expires_at). The event's id, destination, key, body and headers are
-- BLOBs, published byte for byte (a Kafka key or header value may be any
-- bytes): CAST(key AS TEXT) reads one that is text. headers is NULL or a
-- version byte (1), then per header, in name order, the name and the value,
-- each as its length (unsigned varint) and its bytes.
CREATE TABLE IF NOT EXISTS ferry_outbox (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id    BLOB    NOT NULL,
    lane        INTEGER NOT NULL,
    destination BLOB    NOT NULL,
    key         BLOB    NOT NULL DEFAULT x'',
    body        BLOB    NOT NULL,
    headers     BLOB,
    created_at  INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS ferry_outbox_lane_id ON ferry_outbox (lane, id);

CREATE TABLE IF NOT EXISTS ferry_outbox_failed (
    id          INTEGER PRIMARY KEY,
    event_id    BLOB    NOT NULL,
    lane        INTEGER NOT NULL,
    destination BLOB    NOT NULL,
    key         BLOB    NOT NULL,
    body        BLOB    NOT NULL,
    headers     BLOB,
    created_at  INTEGER NOT NULL,
    failed_at   INTEGER NOT NULL,
    reason      TEXT    NOT NULL
);

CREATE TABLE IF NOT EXISTS ferry_outbox_lanes (
    lane       INTEGER PRIMARY KEY,
    owner      TEXT,
    expires_at INTEGER
);
WITH RECURSIVE n(lane) AS (SELECT 0 UNION ALL SELECT lane + 1 FROM n WHERE lane < 63)
INSERT OR IGNORE INTO ferry_outbox_lanes (lane) SELECT lane FROM n;

CREATE TABLE IF NOT EXISTS ferry_outbox_relays (
    owner      TEXT    PRIMARY KEY,
    expires_at INTEGER NOT NULL
);
