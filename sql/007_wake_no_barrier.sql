-- The wake trigger only looks at 'awake': a commit that sees the relay
-- awake takes no lock at all; and while the relay is awake, a row does not
-- queue the trigger at all (its WHEN, at the end of this file).
--
-- 005 and 006 made a commit that saw the relay awake hold 'barrier' shared
-- until its end, so that the relay, going idle, could wait for it. Measured
-- beside a relay draining 16 writers' single-job commits, that lock cost
-- the app about a tenth of its write throughput (the look alone cost half
-- as much again, and nothing else in the trigger counts). So the relay now
-- waits for those commits another way, with nothing asked of the app:
--
-- Going idle, the relay releases 'awake' and then reads the ids of the
-- transactions in progress (each holds a lock on its own id, in pg_locks).
-- It drains once more at once, and again as soon as any of those
-- transactions ends (it looks 0.2ms after going idle, then each time the
-- time since has doubled: 0.4ms, 0.8ms, ... up to the fallback poll's
-- interval).
--
-- Why no wake-up is missed. A commit T that does not notify saw 'awake'
-- held in this trigger, before its COMMIT (the trigger is deferred: it runs
-- just before COMMIT, unless the app ran SET CONSTRAINTS ALL IMMEDIATE).
-- T has a transaction id (it inserted a row), and holds the lock on it
-- until its commit is visible. If T's look came before the relay released
-- 'awake', then when the relay reads the transactions in progress, right
-- after that release, T has either committed, and the drain that follows
-- sees its rows, or is listed, and the drain after it ends sees them. If T's look came after the release, T saw the relay idle
-- and notified.
--
-- The bound. T's rows are pushed by the first check after T ends: at most
-- twice as long after the relay went idle as T took to end (and 0.2ms),
-- and never later than the fallback poll. A relay that
-- dies awake releases 'awake' with its session; the next leader reads the
-- transactions in progress when it starts, in the same way.
--
-- Everything else is as in 006: a relay of all queues holds
-- 'stagedrain-awake:<schema>' while awake, a relay with a list of queues
-- holds 'stagedrain-awake:<schema>:<queue>' for each of its queues, 16
-- shards each, and a row of queue Q notifies unless either is held. A
-- relay older than this migration refuses to run on it (schema too new):
-- its barrier would no longer wait for anything.
CREATE OR REPLACE FUNCTION stagedrain_wake() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    shard CONSTANT int := pg_backend_pid() % 16;
    awake CONSTANT int := hashtext('stagedrain-awake:' || TG_TABLE_SCHEMA);
    awake_q int;
BEGIN
    -- Take 'awake' shared and release it at once: this fails while a relay
    -- of all queues holds it (it is awake) or waits for it (going awake).
    IF NOT pg_try_advisory_lock_shared(awake, shard) THEN
        RETURN NULL; -- it will find this row
    END IF;
    PERFORM pg_advisory_unlock_shared(awake, shard);
    -- Groups of queues exist for staged_jobs only (the same function also
    -- serves other sources' tables, whose rows have no queue column).
    IF TG_TABLE_NAME = 'staged_jobs' THEN
        awake_q := hashtext('stagedrain-awake:' || TG_TABLE_SCHEMA || ':' || NEW.queue);
        IF NOT pg_try_advisory_lock_shared(awake_q, shard) THEN
            RETURN NULL; -- the relay of this queue's group will find it
        END IF;
        PERFORM pg_advisory_unlock_shared(awake_q, shard);
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

-- While a relay of all queues is awake, a row does not even queue the
-- trigger: its WHEN looks at 'awake' when the row is inserted (the same
-- look as above: the shard taken shared and released at once, or nothing
-- when it is held), and the function runs, at COMMIT, only for rows
-- inserted while the relay was idle. That saves the app the deferred
-- trigger's queue and a PL/pgSQL call per row while jobs flow (measured in
-- README, "The wake-up"). A row inserted while the relay was awake belongs
-- to a transaction in progress when the relay goes idle, which the relay
-- checks as above (a transaction that then stays open longer than the
-- fallback poll's interval is left to the poll). The lock's key is the
-- schema's, computed here: hashtext('stagedrain-awake:' || schema).
-- Renaming the schema leaves it stale, which only makes every row queue
-- the trigger, as before this migration. Other sources' tables keep the
-- trigger without WHEN.
DO $$
BEGIN
    EXECUTE format(
        'DROP TRIGGER IF EXISTS stagedrain_wake ON staged_jobs;
         CREATE CONSTRAINT TRIGGER stagedrain_wake
             AFTER INSERT ON staged_jobs
             DEFERRABLE INITIALLY DEFERRED
             FOR EACH ROW
             WHEN (pg_try_advisory_lock_shared(%1$s, pg_backend_pid() %% 16)
                   AND pg_advisory_unlock_shared(%1$s, pg_backend_pid() %% 16))
             EXECUTE FUNCTION stagedrain_wake()',
        hashtext('stagedrain-awake:' || current_schema()));
END
$$;
