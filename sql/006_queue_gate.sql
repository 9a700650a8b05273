-- The wake gate per group of queues (relays with --queues).
--
-- Several groups of relays can drain one staged_jobs table, each only its
-- own queues (relay.Config.Queues); the relays of a schema either all drain
-- every queue (one group, as before) or all have lists, equal or disjoint.
-- 005's 'awake' lock is schema-wide: a group that held it would keep
-- commits to another group's queues from notifying that group's idle
-- relay. So each group holds locks of its own queues:
--   'stagedrain-awake:<schema>'            a relay of all queues holds it
--                                          while awake, as before;
--   'stagedrain-awake:<schema>:<queue>'    a relay with a list holds it, for
--                                          each of its queues, while awake;
--   'stagedrain-barrier:<schema>'          a commit holds it shared when it
--   'stagedrain-barrier:<schema>:<queue>'  does not notify because the
--                                          matching 'awake' is held.
-- (16 shards each, as in 003.) A row of queue Q notifies unless the
-- schema's 'awake' or Q's 'awake' is held.
--
-- The trigger looks at the schema's 'awake' exactly as 005 does, and only
-- when that is free (or became free) at Q's:
--   1. Look at 'awake'. Held: take 'barrier' shared until the end of the
--      transaction and look again; still held: do not notify.
--   2. Look at 'awake:Q'. Held: take 'barrier:Q' shared until the end of
--      the transaction and look again; still held: do not notify.
--   3. Notify.
-- Why no wake-up is missed. A relay goes idle in this order: release its
-- 'awake' locks (the schema's, or each of its queues'), take and release
-- every shard of the matching 'barrier' locks, drain once more. A commit T
-- of a row in Q that does not notify saw, after taking barrier lock X
-- (the schema's in step 1, Q's in step 2), the matching 'awake' lock held
-- by a relay R, whose drains take Q's rows (a relay of all queues, or one
-- whose list holds Q). R had not released it yet, so R's barrier on X
-- comes after T took X: R waits for T's COMMIT, and its last drain sees
-- T's rows. This holds for each step alone, so it holds for the two in
-- turn, and even beside a relay of all queues that runs with list relays
-- in spite of their check (see relay.ErrQueueConflict): a commit then
-- skips notifying only for a relay that will drain its row.
--
-- Cost. With a relay of all queues awake, a row costs what it did in 005
-- (step 1 returns). Idle, or with only list relays, a row also looks at
-- 'awake:Q' (hashtext of a short string and a lock-table lookup). A relay
-- older than this migration refuses to run on it (schema too new); this
-- one needs it.
CREATE OR REPLACE FUNCTION stagedrain_wake() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    shard CONSTANT int := pg_backend_pid() % 16;
    awake CONSTANT int := hashtext('stagedrain-awake:' || TG_TABLE_SCHEMA);
    awake_q int;
BEGIN
    IF NOT pg_try_advisory_lock_shared(awake, shard) THEN
        -- A relay of all queues is awake (or going awake).
        PERFORM pg_advisory_xact_lock_shared(hashtext('stagedrain-barrier:' || TG_TABLE_SCHEMA), shard);
        IF NOT pg_try_advisory_lock_shared(awake, shard) THEN
            RETURN NULL; -- still awake: it will find this row
        END IF;
    END IF;
    PERFORM pg_advisory_unlock_shared(awake, shard);
    -- Groups of queues exist for staged_jobs only (the same function also
    -- serves other sources' tables, whose rows have no queue column).
    IF TG_TABLE_NAME = 'staged_jobs' THEN
        awake_q := hashtext('stagedrain-awake:' || TG_TABLE_SCHEMA || ':' || NEW.queue);
        IF NOT pg_try_advisory_lock_shared(awake_q, shard) THEN
            -- The relay of this queue's group is awake (or going awake).
            PERFORM pg_advisory_xact_lock_shared(hashtext('stagedrain-barrier:' || TG_TABLE_SCHEMA || ':' || NEW.queue), shard);
            IF NOT pg_try_advisory_lock_shared(awake_q, shard) THEN
                RETURN NULL; -- still awake: it will find this row
            END IF;
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
