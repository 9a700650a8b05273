-- One commit notifies at a time.
--
-- 010 made a commit notify only while a relay is idle and listening. Under
-- a steady flow of commits the relay is idle now and then, between drains,
-- and every commit in such a moment notified: 2-7% of them at 1,000-2,000
-- commits/s, more on a loaded machine. Each notifying commit takes
-- PostgreSQL's notify lock and keeps it until its commit record is on disk,
-- so those commits wait for each other's WAL flushes: the app kept 81-92%
-- of its write TPS beside a relay (its triggers against twin tables with
-- the triggers disabled, at the same time: stagedrain bench --scenarios
-- app-cost), and on a loaded machine as little as 65%, as slower commits
-- left the relay idle more often and more commits notified.
--
-- Yet one notification is all an idle relay needs. Now a commit that would
-- notify first takes the schema's 'notifying' lock, a transaction-level
-- advisory lock (hashtext('stagedrain-notifying:<schema>'), 0), with a try:
-- if another transaction holds it, that one is notifying now, and this
-- commit does not. The lock is held from the notifier's deferred trigger
-- (just before its commit) until its commit has ended, which is when
-- PostgreSQL sends its notification. At most one commit of a schema waits
-- on the notify lock at a time, and no commit waits on another's: the same
-- pgbench comparison reads 96-101% (patched in by hand, 6 runs).
--
-- Why no wake-up is missed (010's proof, one case more). A commit T that
-- saw a relay idle and did not notify found 'notifying' held by another
-- transaction N, at T's deferred trigger, which runs before T commits. N
-- holds 'notifying' because its own trigger is notifying: N sends its
-- notification when it commits, after T's look; the relays of the schema
-- (every group listens on the one channel) then drain, each going idle
-- again only through gate.sleep, which reads the transactions in progress:
-- T has committed by then, and the claim that follows sees its row, or T
-- is listed, and the relay drains again when T ends. So T's row is drained
-- as if T had notified, a moment later at most. (Not so for a relay woken
-- while idle that drains N's batch and stays idle: 014_wake_behind.sql.)
--
-- Unless N does not commit after all: its trigger ran, then its commit
-- failed (a deferred constraint that fires after ours, a serialization
-- failure, a crash) or it was a transaction being prepared (the setting
-- stagedrain.notify turns the trigger off for those, as before). Then T's
-- row waits for the relay's next wake-up: another commit's notification,
-- or the fallback poll (--poll-interval) at the latest. Late, never lost.
--
-- The lock costs a commit that notifies one more lock-manager call; the
-- others (a relay draining, or none running) never reach it.
CREATE OR REPLACE FUNCTION stagedrain_wake() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    shard CONSTANT int := pg_backend_pid() % 16;
    idle CONSTANT int := hashtext('stagedrain-idle:' || TG_TABLE_SCHEMA);
    idle_q int;
    -- One notifier at a time (012): see 012_wake_one_notifier.sql.
    notifying CONSTANT int := hashtext('stagedrain-notifying:' || TG_TABLE_SCHEMA);
BEGIN
    -- Turned off for this transaction (one that will be prepared): the
    -- relay's next drain, the fallback poll's at the latest, finds the row.
    IF lower(coalesce(current_setting('stagedrain.notify', true), '')) IN ('off', 'false', 'no', '0') THEN
        RETURN NULL;
    END IF;
    -- A relay of all queues is idle: it holds 'idle', so taking it shared
    -- fails. It needs one notification: none while another commit of the
    -- schema is notifying, and holds 'notifying' until it has ended.
    IF NOT (pg_try_advisory_lock_shared(idle, shard) AND pg_advisory_unlock_shared(idle, shard)) THEN
        IF NOT pg_try_advisory_xact_lock(notifying, 0) THEN
            RETURN NULL;
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
                RETURN NULL;
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
