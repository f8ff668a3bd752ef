-- Ferry transactional outbox, PostgreSQL, version 2: events held until a
-- time (outbox.Event.NotBefore).
-- not_before is NULL for an event to publish at once. A relay reads the
-- events of its lanes that are due: those with no not_before in id order,
-- lane by lane through ferry_outbox_ready, or through ferry_outbox_ready_id
-- when it holds every lane; and the held ones whose not_before has passed,
-- in time order through ferry_outbox_scheduled. Each keeps a read's plan
-- cheap even before the table has statistics. An event
-- written behind a held event of its key gets that event's not_before when
-- its own is earlier (found in ferry_outbox_scheduled_key), so a key's
-- events fall due in their order.
ALTER TABLE ferry_outbox ADD COLUMN IF NOT EXISTS not_before timestamptz;
CREATE INDEX IF NOT EXISTS ferry_outbox_ready ON ferry_outbox (lane, id) WHERE not_before IS NULL;
CREATE INDEX IF NOT EXISTS ferry_outbox_ready_id ON ferry_outbox (id) WHERE not_before IS NULL;
CREATE INDEX IF NOT EXISTS ferry_outbox_scheduled ON ferry_outbox (not_before, id) WHERE not_before IS NOT NULL;
CREATE INDEX IF NOT EXISTS ferry_outbox_scheduled_key ON ferry_outbox (lane, key, not_before) WHERE not_before IS NOT NULL;
-- ferry_outbox_ready does its work.
DROP INDEX IF EXISTS ferry_outbox_lane_id;
