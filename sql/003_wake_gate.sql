-- The gated wake-up: commits NOTIFY only while the relay is idle.
--
-- Every transaction that NOTIFYs takes PostgreSQL's database-wide notify
-- lock at COMMIT, so notifying commits run one at a time: 001's plain
-- trigger cost a 16-writer app most of its write throughput. Here a commit
-- notifies only when the relay is idle; while the relay is awake (draining)
-- it will find the row by itself, and commits do not notify.
--
-- Two advisory locks per schema, each in 16 shards (two-key advisory locks:
-- hashtext(name), shard), a committing backend using shard pid % 16 so that
-- concurrent commits do not queue on one lock's partition:
--   'stagedrain-awake:<schema>'   the leading relay holds every shard
--                                 exclusively (session level) while awake.
--   'stagedrain-barrier:<schema>' every committing transaction holds its
--                                 shard shared until its COMMIT is done; the
--                                 relay takes each shard exclusively for an
--                                 instant when it goes idle, so it waits for
--                                 every commit already past its check.
--
-- The check runs in a deferred constraint trigger, at COMMIT, so a lock is
-- held only from the check to the end of the commit, never while the app's
-- transaction is still working. (Its cost per row is a lock-table lookup:
-- a transaction's second row finds both locks already held.)
--
-- Why no wake-up is missed. The relay goes idle in this order: release
-- 'awake', take and release 'barrier', drain once more. A committing
-- transaction T takes 'barrier' shared, then tries 'awake' shared:
--   - if T took 'barrier' after the relay's instant on it, T's try comes
--     after the relay released 'awake': it succeeds and T NOTIFYs;
--   - if before, the relay's barrier waits for T's COMMIT, so the relay's
--     last drain sees T's rows, whether T notified or not.
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
    shard CONSTANT int := pg_backend_pid() % 16;
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtext('stagedrain-barrier:' || TG_TABLE_SCHEMA), shard);
    IF pg_try_advisory_xact_lock_shared(hashtext('stagedrain-awake:' || TG_TABLE_SCHEMA), shard) THEN
        -- The relay is idle. The channel is relay.ChannelName(schema);
        -- PostgreSQL sends identical notifications of a transaction once.
        PERFORM pg_notify(
            CASE WHEN octet_length('stagedrain_' || TG_TABLE_SCHEMA) <= 63
                 THEN 'stagedrain_' || TG_TABLE_SCHEMA
                 ELSE 'stagedrain_' || md5(TG_TABLE_SCHEMA)
            END,
            '');
    END IF;
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS stagedrain_wake ON staged_jobs;
CREATE CONSTRAINT TRIGGER stagedrain_wake
    AFTER INSERT ON staged_jobs
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION stagedrain_wake();
