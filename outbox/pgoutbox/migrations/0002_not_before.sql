-- Ferry transactional outbox, PostgreSQL, version 2: events held until a
-- time (outbox.Event.NotBefore).
-- not_before is NULL for an event to publish at once. A relay reads the
-- events of its lanes that are due: not_before NULL, in id order through
-- ferry_outbox_ready (whose lane column lets it skip other relays' lanes
-- without reading the rows), or past, in time order through
-- ferry_outbox_scheduled. Both keep a read's plan cheap even before the
-- table has statistics. An event
-- written behind a waiting event of its key gets that event's not_before
-- when its own is earlier (found in ferry_outbox_scheduled_key), so a key's
-- events fall due in their order.
ALTER TABLE ferry_outbox ADD COLUMN IF NOT EXISTS not_before timestamptz;
CREATE INDEX IF NOT EXISTS ferry_outbox_ready ON ferry_outbox (id, lane) WHERE not_before IS NULL;
CREATE INDEX IF NOT EXISTS ferry_outbox_scheduled ON ferry_outbox (not_before, id) WHERE not_before IS NOT NULL;
CREATE INDEX IF NOT EXISTS ferry_outbox_scheduled_key ON ferry_outbox (lane, key, not_before) WHERE not_before IS NOT NULL;
-- ferry_outbox_ready does its work.
DROP INDEX IF EXISTS ferry_outbox_lane_id;
