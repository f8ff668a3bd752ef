-- Ferry transactional outbox, PostgreSQL, version 1.
-- Events wait in ferry_outbox until a relay published them; id orders them.
-- The event's id, destination, key, body and headers are bytes, published
-- byte for byte (a Kafka key or header value may be any bytes):
-- convert_from(key, 'UTF8') reads one that is text. headers is NULL or a
-- version byte (1), then per header, in name order, the name and the value,
-- each as its length (unsigned varint) and its bytes.
CREATE TABLE IF NOT EXISTS ferry_outbox (
    id          bigserial   PRIMARY KEY,
    event_id    bytea       NOT NULL,
    lane        smallint    NOT NULL,
    destination bytea       NOT NULL,
    key         bytea       NOT NULL DEFAULT '',
    body        bytea       NOT NULL,
    headers     bytea,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS ferry_outbox_lane_id ON ferry_outbox (lane, id);

-- Events a publisher refused for good, with the reason.
CREATE TABLE IF NOT EXISTS ferry_outbox_failed (
    id          bigint      PRIMARY KEY,
    event_id    bytea       NOT NULL,
    lane        smallint    NOT NULL,
    destination bytea       NOT NULL,
    key         bytea       NOT NULL,
    body        bytea       NOT NULL,
    headers     bytea,
    created_at  timestamptz NOT NULL,
    failed_at   timestamptz NOT NULL DEFAULT now(),
    reason      text        NOT NULL
);

-- One row per lane: which relay holds it, and until when.
CREATE TABLE IF NOT EXISTS ferry_outbox_lanes (
    lane       smallint    PRIMARY KEY,
    owner      text,
    expires_at timestamptz
);
INSERT INTO ferry_outbox_lanes (lane)
    SELECT generate_series(0, 63) ON CONFLICT (lane) DO NOTHING;

-- Live relays, so that each can work out its fair share of the lanes.
CREATE TABLE IF NOT EXISTS ferry_outbox_relays (
    owner      text        PRIMARY KEY,
    expires_at timestamptz NOT NULL
);
