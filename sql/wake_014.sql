-- stagedrain_wake(), as migration 014 (014_wake_behind.sql) defines it:
-- the current definition, and the one place the code takes it from. Its
-- mechanism and the proof that no wake-up is missed are in the comments of
-- 014_wake_behind.sql, 012_wake_one_notifier.sql and 010_wake_when_idle.sql
-- (and of 009, 007 and 005, which they build on).
--
-- Two kinds of schema run it:
--   - a fresh install: Migrate applies wake_009.sql and baseline_009.sql,
--     then migrations 010, 012 and 014, which define this function again;
--   - a sidekiq_staged_push schema (relay.WithSource): Migrate applies this
--     file and adds a trigger without WHEN on the gem's table, whose
--     comment records the version, "stagedrain_wake 14", for Run's check.
--
-- The file is never edited. A later migration that changes the function
-- adds wake_NNN.sql (NNN its version) beside this one; Migrate then takes
-- the highest for the gem's table, and TestWakeFileIsCurrent fails until
-- the file agrees with the function a full Migrate gives staged_jobs.
CREATE OR REPLACE FUNCTION stagedrain_wake() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    shard CONSTANT int := pg_backend_pid() % 16;
    idle CONSTANT int := hashtext('stagedrain-idle:' || TG_TABLE_SCHEMA);
    idle_q int;
    -- One notifier at a time (012): see 012_wake_one_notifier.sql.
    notifying CONSTANT int := hashtext('stagedrain-notifying:' || TG_TABLE_SCHEMA);
    -- Held by a commit that may not notify (014): see 014_wake_behind.sql.
    behind CONSTANT int := hashtext('stagedrain-behind:' || TG_TABLE_SCHEMA);
BEGIN
    -- Turned off for this transaction (one that will be prepared): the
    -- relay's next drain, the fallback poll's at the latest, finds the row.
    IF lower(coalesce(current_setting('stagedrain.notify', true), '')) IN ('off', 'false', 'no', '0') THEN
        RETURN NULL;
    END IF;
    -- A relay of all queues is idle: it holds 'idle', so taking it shared
    -- fails. It needs one notification: none while another commit of the
    -- schema is notifying, and holds 'notifying' until it has ended. One
    -- that finds 'notifying' held takes 'behind' shared (held until it
    -- ends) and tries again: it does not notify only if 'notifying' is
    -- still held; if the relay is looking at 'behind' this moment, it
    -- notifies.
    IF NOT (pg_try_advisory_lock_shared(idle, shard) AND pg_advisory_unlock_shared(idle, shard)) THEN
        IF NOT pg_try_advisory_xact_lock(notifying, 0) THEN
            IF pg_try_advisory_xact_lock_shared(behind, 0) THEN
                IF NOT pg_try_advisory_xact_lock(notifying, 0) THEN
                    RETURN NULL;
                END IF;
            END IF;
        END IF;
        PERFORM pg_notify(
            CASE WHEN octet_length('stagedrain_' || TG_TABLE_SCHEMA) <= 63
                 THEN 'stagedrain_' || TG_TABLE_SCHEMA
                 ELSE 'stagedrain_' || md5(TG_TABLE_SCHEMA)
            END,
            '');
        RETURN NULL;
    END IF;
    -- Groups of queues exist for staged_jobs only (the same function also
    -- serves other sources' tables, whose rows have no queue column).
    IF TG_TABLE_NAME = 'staged_jobs' THEN
        idle_q := hashtext('stagedrain-idle:' || TG_TABLE_SCHEMA || ':' || NEW.queue);
        IF NOT (pg_try_advisory_lock_shared(idle_q, shard) AND pg_advisory_unlock_shared(idle_q, shard)) THEN
            -- The relay of this queue's group is idle. The channel is
            -- relay.ChannelName(schema), one for every group, so that
            -- another commit's notification wakes it too.
            IF NOT pg_try_advisory_xact_lock(notifying, 0) THEN
                IF pg_try_advisory_xact_lock_shared(behind, 0) THEN
                    IF NOT pg_try_advisory_xact_lock(notifying, 0) THEN
                        RETURN NULL;
                    END IF;
                END IF;
            END IF;
            PERFORM pg_notify(
                CASE WHEN octet_length('stagedrain_' || TG_TABLE_SCHEMA) <= 63
                     THEN 'stagedrain_' || TG_TABLE_SCHEMA
                     ELSE 'stagedrain_' || md5(TG_TABLE_SCHEMA)
                END,
                '');
        END IF;
    END IF;
    -- Nobody idle: a relay draining finds the row by itself, and a relay
    -- that starts drains what was staged meanwhile.
    RETURN NULL;
END
$$;
