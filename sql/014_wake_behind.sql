-- A commit behind a notifier is drained when it ends.
--
-- 012 lets one commit of a schema notify at a time: a commit T that would
-- notify an idle relay does not while another commit N holds the schema's
-- 'notifying' lock, and N's notification wakes the relay. Its proof
-- assumed that the woken relay reads the transactions in progress before
-- it is idle again; but a relay woken while idle drains N's batch and
-- stays idle, reading nothing, and a T whose commit ended after that
-- drain's claim (T's look runs just before its commit; its WAL flush can
-- end a group commit after N's) waited for the next wake-up, the fallback
-- poll (--poll-interval, 1 s by default) at the latest
-- (TestCommitEndingAfterTheNotifiersDrainIsDrained).
--
-- Reading the transactions in progress at every such drain fixes it, and
-- costs every drain a read of pg_stat_activity and then checks of what it
-- lists (a drain again when one of them ends): at 100 jobs/s, late-commit
-- wake-ups went from 2-13 to 53-82 in 10 s, and the latency rows of
-- stagedrain bench read 0.2-0.7 ms worse. So a commit says when it did not
-- notify: when it finds 'notifying' held, it takes the schema's 'behind'
-- lock, a shared transaction-level advisory lock
-- (hashtext('stagedrain-behind:<schema>'), 0), held until it ends, and
-- tries 'notifying' once more; it does not notify only if that fails too.
-- Shared locks do not wait for each other, and only the commits that skip
-- (about 1-2% of those that see a relay idle) take it.
--
-- The relay's first claim after waking idle tries 'behind' exclusively,
-- and lets it go in the same expression; only when that fails (a commit
-- holds it) does it read the transactions in progress, in the same round
-- trip, before the claim's snapshot, into its late-commit checks.
--
-- Why no wake-up is missed. T did not notify: it holds 'behind', taken
-- before its second try of 'notifying', which failed while some M held
-- it. M's notification is sent after M's commit has released its locks
-- (PostgreSQL's CommitTransaction signals listeners after it releases
-- them), so after T took 'behind'; every notification the relay receives
-- is followed by a drain that starts after it. If that drain starts idle,
-- its look finds 'behind' held by T, and lists the transactions in
-- progress: T is among them (drained again when it ends) or has committed
-- (the claim that follows sees its row); or T has released 'behind', which
-- it does after its commit is visible, and that claim sees its row. If the
-- drain starts awake, it goes idle only through its gate's sleep, which
-- reads the transactions in progress anyway (010). If the relay holds
-- 'behind' at the moment T tries it (its look, microseconds), T cannot
-- take it and notifies, as before 012.
--
-- Replaces stagedrain_wake() only: no lock on
-- staged_jobs, the trigger is unchanged. With the sidekiq-staged_push
-- source, Migrate installs wake_014.sql on the gem's table.
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
