-- The wake trigger looks at 'awake' instead of holding it, and takes
-- 'barrier' only when it does not notify.
--
-- 003's trigger took 'barrier' shared and then 'awake' shared, both held to
-- the end of the transaction. A commit that found the relay idle, and so
-- notified, held both while it waited for PostgreSQL's notify lock behind
-- every other notifying commit. The relay, going awake, waited for that
-- whole queue on 'awake'; going idle, it waited for it again on 'barrier';
-- and while it waited on one shard, commits on the shards it had not reached
-- went on joining the queue. Under a burst of commits the relay spent tens
-- to hundreds of milliseconds in these waits, and most commits notified,
-- one at a time.
--
-- Only commits that do not notify need the barrier: the relay's barrier
-- exists to wait for them. So now:
--   1. Look at 'awake' (take it shared at session level and release it at
--      once; it fails while the relay holds it or waits for it). Idle: notify,
--      and take nothing.
--   2. Awake: take 'barrier' shared until the end of the transaction, then
--      look at 'awake' again. Idle now: notify. Still awake: do not.
-- Why no wake-up is missed. The relay goes idle in this order: release
-- 'awake', take and release every shard of 'barrier', drain once more. A
-- commit T that does not notify saw the relay awake after it took
-- 'barrier'. If T took its shard of 'barrier' before the relay's instant on
-- it, the relay waits for T's COMMIT, and its last drain sees T's rows. If
-- after, the relay had released 'awake' before, so T's second look saw it
-- idle, and T notified. The relay's lock on 'awake' now waits at most for
-- another backend's look, a few microseconds, and its barrier only for
-- commits that saw it awake, which do not queue for the notify lock.
CREATE OR REPLACE FUNCTION stagedrain_wake() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    shard CONSTANT int := pg_backend_pid() % 16;
    awake CONSTANT int := hashtext('stagedrain-awake:' || TG_TABLE_SCHEMA);
BEGIN
    IF NOT pg_try_advisory_lock_shared(awake, shard) THEN
        -- The relay is awake (or going awake).
        PERFORM pg_advisory_xact_lock_shared(hashtext('stagedrain-barrier:' || TG_TABLE_SCHEMA), shard);
        IF NOT pg_try_advisory_lock_shared(awake, shard) THEN
            RETURN NULL; -- still awake: it will find this row
        END IF;
    END IF;
    PERFORM pg_advisory_unlock_shared(awake, shard);
    -- The relay is idle. The channel is relay.ChannelName(schema);
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
