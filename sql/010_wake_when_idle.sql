-- A commit notifies only while a relay says it is idle and listening.
--
-- 009 and before asked the opposite question: a commit notified unless a
-- relay held 'awake'. So with no relay running (deployed, crashed, stopped),
-- or a relay stuck on a Redis that is down or hung, nobody held 'awake' and
-- every commit took PostgreSQL's notify lock, which serializes notifying
-- commits database-wide: the app kept 15-33% of its write throughput for
-- nobody's benefit (pgbench, 16 clients, one row per transaction).
--
-- Now the leading relay holds 'idle' (hashtext('stagedrain-idle:<schema>'),
-- 16 shards, the shard being the app backend's pid % 16) while it is idle
-- and listening, and releases it while it drains, while it cannot push
-- (its drain failed and waits to retry), while Redis is nearly full
-- (memory backpressure) and when it stops leading. A relay
-- with a list of queues holds 'stagedrain-idle:<schema>:<queue>' for each
-- of its queues instead. A row of queue Q notifies only while the schema's
-- 'idle' or Q's 'idle' is held; with nobody holding either, a commit pays
-- two lock looks and nothing else. A dead relay's locks go with its
-- session, so a relay that dies costs the app nothing either.
--
-- The look is the same expression as 009's, read the other way: taking a
-- lock shared and releasing it at once fails while a relay holds it
-- exclusively (or waits for it, going idle):
--     NOT (pg_try_advisory_lock_shared(k, s) AND pg_advisory_unlock_shared(k, s))
-- is true while the relay is idle. Nothing can end the statement between
-- the take and the release (009, 1).
--
-- Why no wake-up is missed. This is 007's proof with the lock's meaning
-- flipped; what matters is only the moment the relay goes from "commits
-- need not notify" to "commits notify", which is now its taking 'idle'
-- instead of its releasing 'awake'. A row R of transaction T that queues no
-- notification saw 'idle' free, at INSERT (the WHEN) or at COMMIT (the
-- function), after T had its transaction id. Going idle, the relay takes
-- 'idle' and then, in the same round trip, reads the ids of the
-- transactions in progress (relay/wake.go). If T's look came before the
-- relay held 'idle', T has then either committed, and the drain that
-- follows sees R, or is listed, and the relay drains again when T ends (or
-- leaves it to the fallback poll past the poll's interval). If T's look
-- came after, T saw the relay idle and notified. A relay that was not
-- running when T committed drains everything at start (and reads the
-- transactions in progress then, the same way). The bound is 007's.
--
-- The opt-out (009, 2) and the once-per-transaction-and-queue setting
-- (009, 3) are kept; the setting now remembers the queue of the last row
-- that queued the trigger as before, and the proof of 009, 3 holds as it
-- stands (its case b reads "saw 'idle' free").
--
-- A relay older than this migration refuses to run on it (schema too new),
-- and this one refuses an older schema (not migrated): a relay of either
-- kind on the other's trigger would be woken by every commit or by none.
CREATE OR REPLACE FUNCTION stagedrain_wake() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    shard CONSTANT int := pg_backend_pid() % 16;
    idle CONSTANT int := hashtext('stagedrain-idle:' || TG_TABLE_SCHEMA);
    idle_q int;
BEGIN
    -- Turned off for this transaction (one that will be prepared): the
    -- relay's next drain, the fallback poll's at the latest, finds the row.
    IF lower(coalesce(current_setting('stagedrain.notify', true), '')) IN ('off', 'false', 'no', '0') THEN
        RETURN NULL;
    END IF;
    -- A relay of all queues is idle: it holds 'idle', so taking it shared fails.
    IF NOT (pg_try_advisory_lock_shared(idle, shard) AND pg_advisory_unlock_shared(idle, shard)) THEN
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
            -- relay.ChannelName(schema), one for every group.
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

-- The trigger: 009's WHEN with the look read the other way, and the
-- queue's 'idle' looked at too (a row queues the trigger only when a relay
-- that drains it is idle). Keys and the setting's name are computed here,
-- as in 009.
DO $$
BEGIN
    EXECUTE format(
        'DROP TRIGGER IF EXISTS stagedrain_wake ON staged_jobs;
         CREATE CONSTRAINT TRIGGER stagedrain_wake
             AFTER INSERT ON staged_jobs
             DEFERRABLE INITIALLY DEFERRED
             FOR EACH ROW
             WHEN (current_setting(%2$L, true) IS DISTINCT FROM NEW.queue
                   AND (NOT (pg_try_advisory_lock_shared(%1$s, pg_backend_pid() %% 16)
                             AND pg_advisory_unlock_shared(%1$s, pg_backend_pid() %% 16))
                        OR NOT (pg_try_advisory_lock_shared(hashtext(%3$L || NEW.queue), pg_backend_pid() %% 16)
                                AND pg_advisory_unlock_shared(hashtext(%3$L || NEW.queue), pg_backend_pid() %% 16)))
                   AND set_config(%2$L, NEW.queue, true) IS NOT NULL)
             EXECUTE FUNCTION stagedrain_wake()',
        hashtext('stagedrain-idle:' || current_schema()),
        'stagedrain.wake_' || 'staged_jobs'::regclass::oid,
        'stagedrain-idle:' || current_schema() || ':');
END
$$;
