-- Ferry transactional outbox, SQLite, version 2: events held until a time
-- (outbox.Event.NotBefore), as on PostgreSQL (see its 0002_not_before.sql).
-- not_before is Unix microseconds, NULL for an event to publish at once.
ALTER TABLE ferry_outbox ADD COLUMN not_before INTEGER;
CREATE INDEX IF NOT EXISTS ferry_outbox_ready ON ferry_outbox (id, lane) WHERE not_before IS NULL;
CREATE INDEX IF NOT EXISTS ferry_outbox_scheduled ON ferry_outbox (not_before, id) WHERE not_before IS NOT NULL;
CREATE INDEX IF NOT EXISTS ferry_outbox_scheduled_key ON ferry_outbox (lane, key, not_before) WHERE not_before IS NOT NULL;
DROP INDEX IF EXISTS ferry_outbox_lane_id;
