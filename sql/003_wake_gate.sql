-- The gated wake-up: commits NOTIFY only while the relay is idle.
--
-- Every transaction that NOTIFYs takes PostgreSQL's database-wide notify
-- lock at COMMIT, so notifying commits run one at a time: 001's plain
-- trigger cost a 16-writer app most of its write throughput. Here a commit
-- notifies only when the relay is idle; while the relay is awake (draining)
-- it will find the row by itself, and commits do not notify.
--
-- Two advisory locks per schema (keys: hashtextextended(name, 0)):
--   'stagedrain-awake:<schema>'   the leading relay holds it exclusively
--                                 (session level) while it is awake.
--   'stagedrain-barrier:<schema>' a committing transaction that saw the relay
--                                 awake holds it shared until its COMMIT is
--                                 done; the relay takes it exclusively for an
--                                 instant when it goes idle, so it waits for
--                                 every such commit before its last drain.
--
-- The check runs in a deferred constraint trigger, at COMMIT, once per
-- transaction (a transaction-local setting marks it done), so a lock is held
-- only from the check to the end of the commit, never while the app's
-- transaction is still working.
--
-- Why no wake-up is missed. The relay goes idle in this order: release
-- 'awake', take and release 'barrier' (waiting for its shared holders), drain
-- once more. A committing transaction T:
--   1. tries 'awake' shared: it succeeds only if the relay is idle (or is
--      going idle), and then T NOTIFYs at COMMIT;
--   2. otherwise takes 'barrier' shared (queued behind the relay's exclusive
--      request if the relay is in that instant), and
--   3. tries 'awake' shared again: if the relay released it meanwhile, T
--      NOTIFYs; if not, the relay is still awake and its coming barrier will
--      wait for T's COMMIT, so its last drain sees T's rows.
-- The relay's barrier waits at most 200ms (lock_timeout): a transaction that
-- holds 'barrier' longer (only possible after SET CONSTRAINTS ALL IMMEDIATE,
-- which runs this trigger at INSERT time) is delivered by the fallback poll.
-- With no relay running, nobody holds 'awake' and every commit notifies, as
-- with 001's trigger; a relay of the previous version keeps working.

DROP TRIGGER IF EXISTS stagedrain_notify ON staged_jobs;
DROP FUNCTION IF EXISTS stagedrain_notify();

CREATE OR REPLACE FUNCTION stagedrain_wake() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    done_key CONSTANT text := 'stagedrain.woken_' || TG_RELID;
    awake_key bigint;
BEGIN
    -- Once per transaction and table: the first row decides for all.
    IF current_setting(done_key, true) = 'y' THEN
        RETURN NULL;
    END IF;
    PERFORM set_config(done_key, 'y', true);

    awake_key := hashtextextended('stagedrain-awake:' || TG_TABLE_SCHEMA, 0);
    IF NOT pg_try_advisory_xact_lock_shared(awake_key) THEN
        PERFORM pg_advisory_xact_lock_shared(hashtextextended('stagedrain-barrier:' || TG_TABLE_SCHEMA, 0));
        IF NOT pg_try_advisory_xact_lock_shared(awake_key) THEN
            RETURN NULL; -- the relay is awake and will wait for this commit
        END IF;
    END IF;
    -- The channel is relay.ChannelName(schema).
    PERFORM pg_notify(
        CASE WHEN octet_length('stagedrain_' || TG_TABLE_SCHEMA) <= 63
             THEN 'stagedrain_' || TG_TABLE_SCHEMA
             ELSE 'stagedrain_' || md5(TG_TABLE_SCHEMA)
        END,
        '');
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS stagedrain_wake ON staged_jobs;
CREATE CONSTRAINT TRIGGER stagedrain_wake
    AFTER INSERT ON staged_jobs
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION stagedrain_wake();
