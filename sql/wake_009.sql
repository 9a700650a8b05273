-- stagedrain_wake(), as migration 009 (009_wake_once.sql) defines it: the
-- current definition, and the one place the code takes it from. Its
-- mechanism and the proof that no wake-up is missed are in the comments of
-- 009_wake_once.sql (and of 007 and 005, which it builds on).
--
-- Two kinds of schema run it:
--   - a fresh install: Migrate applies this file, then baseline_009.sql,
--     whose trigger on staged_jobs runs it;
--   - a sidekiq_staged_push schema (relay.WithSource): Migrate applies this
--     file and adds a trigger without WHEN on the gem's table, whose
--     comment records the version, "stagedrain_wake 9", for Run's check.
--
-- The file is never edited. A later migration that changes the function
-- adds wake_NNN.sql (NNN its version) beside this one; Migrate then takes
-- the highest for the gem's table, and TestWakeFileIsCurrent fails until
-- the file agrees with the function a full Migrate gives staged_jobs.
CREATE OR REPLACE FUNCTION stagedrain_wake() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    shard CONSTANT int := pg_backend_pid() % 16;
    awake CONSTANT int := hashtext('stagedrain-awake:' || TG_TABLE_SCHEMA);
    awake_q int;
BEGIN
    -- Turned off for this transaction (one that will be prepared): the
    -- relay's next drain, the fallback poll's at the latest, finds the row.
    IF lower(coalesce(current_setting('stagedrain.notify', true), '')) IN ('off', 'false', 'no', '0') THEN
        RETURN NULL;
    END IF;
    -- Take 'awake' shared and release it at once, in one expression: this
    -- fails while a relay of all queues holds it (it is awake) or waits for
    -- it (going awake).
    IF NOT (pg_try_advisory_lock_shared(awake, shard) AND pg_advisory_unlock_shared(awake, shard)) THEN
        RETURN NULL; -- it will find this row
    END IF;
    -- Groups of queues exist for staged_jobs only (the same function also
    -- serves other sources' tables, whose rows have no queue column).
    IF TG_TABLE_NAME = 'staged_jobs' THEN
        awake_q := hashtext('stagedrain-awake:' || TG_TABLE_SCHEMA || ':' || NEW.queue);
        IF NOT (pg_try_advisory_lock_shared(awake_q, shard) AND pg_advisory_unlock_shared(awake_q, shard)) THEN
            RETURN NULL; -- the relay of this queue's group will find it
        END IF;
    END IF;
    -- Idle. The channel is relay.ChannelName(schema), one for every group;
    -- PostgreSQL sends identical notifications of a transaction once.
    PERFORM pg_notify(
        CASE WHEN octet_length('stagedrain_' || TG_TABLE_SCHEMA) <= 63
             THEN 'stagedrain_' || TG_TABLE_SCHEMA
             ELSE 'stagedrain_' || md5(TG_TABLE_SCHEMA)
        END,
        '');
    RETURN NULL;
END
$$;
