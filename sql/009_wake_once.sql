-- The wake trigger runs once per transaction and queue, leaves nothing
-- held in the app's session, and can be turned off for one transaction.
--
-- 0. The gate as a whole (003, 005-007 and this file; the README keeps only
-- what users see and pay). Every transaction that NOTIFYs takes a
-- database-wide lock at COMMIT, so notifying commits run one at a time: a
-- trigger that notified on every commit cost a busy app most of its write
-- throughput (16 writers of one job per transaction: 1,455-1,705 TPS
-- against 4,937-6,537 without a trigger). So the trigger notifies only
-- while the relay is idle:
--   - The leading relay holds the advisory lock 'awake'
--     (hashtext('stagedrain-awake:<schema>'), 16 shards, the shard being
--     the app backend's pid % 16) while it drains. It takes it from the
--     second batch of a drain (jobs are flowing), or from the first when it
--     went idle less than 0.5ms before; it keeps claiming while claims find
--     jobs, and after an empty claim looks again (after a quarter of the
--     time since it last found jobs: 100us at first, at most 1ms) for up to
--     0.5ms, or 20ms while jobs flow at 2,000/s or more, before it goes idle
--     (relay/drain.go). A relay with a list of queues holds instead
--     'stagedrain-awake:<schema>:<queue>' for each of its queues; a row of
--     queue Q notifies unless the schema's or Q's 'awake' is held. Every
--     group listens on the schema's one channel.
--   - A row looks at 'awake' twice: in the trigger's WHEN, as it is
--     inserted (held: the row queues no event, and the commit pays nothing
--     more), and, if it queued the deferred event, in the function at
--     COMMIT (held by now: it returns; still free: pg_notify).
--   - Going idle, the relay releases 'awake' and, in the same round trip,
--     reads the ids of the transactions in progress (each holds a lock on
--     its own id, in pg_locks). It drains once more at once, and again
--     whenever one of them ends: it checks 0.2ms after going idle, then
--     each time the youngest one's age has doubled (0.4ms, 0.8ms, ...), up
--     to the fallback poll's interval (relay/wake.go; those drains count as
--     stagedrain_wakeups_total{cause="late_commit"}).
-- The proof that no wake-up is missed is 007's, extended under 3 below. The
-- bound it gives: a job whose commit skipped NOTIFY and ended after the
-- relay went idle is pushed by the first check after that commit, within
-- about twice as long after the relay went idle as the commit took to end
-- (plus 0.2ms and a round trip), and never later than the fallback poll. A
-- transaction still open that long (one that staged while the relay was
-- awake and then worked on, or a prepared transaction waiting for COMMIT
-- PREPARED) is left to the poll; a long-open app transaction costs the
-- relay one check each time its age doubles, not one per idle moment
-- (TestLateCommitIsDrainedWithoutNotifyOrPoll, TestLateCommitsSchedule).
-- Why these choices. A lock, not a flag the relay sets (a sequence's value,
-- say): the lock goes with the relay's session when it dies, where a flag
-- would stay 'awake', and it needs no grant to the app's role; how the
-- trigger looks (lock or sequence) measured the same. No barrier lock held
-- to the commit's end (005, 006): it cost the app about a tenth of its
-- write throughput, and reading the transactions in progress waits for
-- those commits instead, with nothing asked of the app. A look at INSERT
-- (the WHEN) rather than only at COMMIT is safe for the same reason: the
-- relay, going idle, waits for every transaction in progress, whenever it
-- looked; and it spares the commit the trigger event and function call
-- while the relay is awake, worth another 5-10% of the app's throughput.
--
-- 1. One look, one expression. 007's function took 'awake' shared in one
-- PL/pgSQL statement and released it in the next. PostgreSQL acts on a
-- cancel or a statement_timeout at the start of a statement, so one that
-- arrived between the two made the COMMIT fail with the shared lock still
-- taken: a session-level advisory lock outlives the transaction, and the
-- app's pooled connection kept a shard of 'awake' until it closed (the
-- relay then waited for it going awake, up to its lock_timeout, and the
-- commits of that shard went on notifying). Here the take and the release
-- are one expression,
--     pg_try_advisory_lock_shared(k, s) AND pg_advisory_unlock_shared(k, s)
-- as the WHEN of 007 already was: PostgreSQL acts on interrupts between
-- statements and while waiting, and neither function waits, so nothing can
-- end the statement between them (and AND releases only what it took). Not pg_try_advisory_xact_lock_shared: held to the end of
-- the transaction, it would make the relay, going awake, wait for every
-- commit that saw it idle, through the queue for PostgreSQL's notify lock
-- (005 removed exactly that), and in the WHEN, run at INSERT, for every
-- app transaction that staged a row while the relay was idle.
--
-- 2. The opt-out. A transaction that calls pg_notify cannot be prepared
-- (PREPARE TRANSACTION fails: "cannot PREPARE a transaction that has
-- executed LISTEN, UNLISTEN, or NOTIFY"), and a trigger cannot know that
-- its transaction will be prepared. So the function does nothing in a
-- transaction that ran
--     SET LOCAL stagedrain.notify = 'off';
-- (any time before its PREPARE TRANSACTION or COMMIT; off, false, no or 0).
-- Its rows are found by the relay's next drain: the fallback poll's
-- interval at the latest, sooner when the relay is awake or another commit
-- wakes it.
--
-- 3. Once per transaction and queue. 007 queued a deferred event for every
-- row inserted while the relay was idle, and ran the function for each at
-- COMMIT: a 10,000-row transaction ran it 10,000 times. Now the trigger's
-- WHEN remembers, in a transaction-local setting
-- ('stagedrain.wake_<oid of staged_jobs>', set_config(..., true)), the
-- queue of the last row that queued the trigger, and a row of that queue
-- queues nothing: a transaction that stages rows of one queue queues one
-- event, and runs the function once. The WHEN, in order:
--   a. the setting is not this row's queue (else: nothing to do);
--   b. the look at the schema's 'awake', as in 007 (held: nothing to do);
--   c. set the setting to this row's queue, and queue the trigger.
-- The function, at COMMIT, is 007's (with 1 and 2): it looks at the
-- schema's 'awake' and then the row's queue's, and notifies if both are
-- free.
--
-- Why no wake-up is missed (007's proof, for rows that now queue nothing).
-- A row R of queue Q in transaction T queues no event in two cases:
--   - b: T saw 'awake' held, after R was inserted (so T had its
--     transaction id). As in 007: if the relay released 'awake' after this
--     look, it then read the transactions in progress, and T had either
--     committed, and the drain that follows sees R, or was listed, and the
--     relay drains again when T ends (or, after the fallback poll's
--     interval, leaves T to the poll).
--   - a: an earlier row R' of T, of the same queue Q, queued the event,
--     and T did not roll back to a savepoint before it since (a rollback
--     to a savepoint discards both the event and the setting made after
--     it: they are undone together). That event runs the function in T for
--     queue Q, at COMMIT, and what it decides holds for R as it does for
--     R': the same transaction, the same queue, the same looks at the same
--     moment. (Under SET CONSTRAINTS ALL IMMEDIATE it runs at the end of
--     R''s statement instead: if it saw the relay idle it notified, which
--     is sent at T's COMMIT, after R; if awake, the first case holds for R:
--     that look came after T had its id, and nothing in it needs R to be
--     inserted before it.)
-- The setting names the table by its oid, so rows of another schema's
-- staged_jobs in the same transaction are flagged apart (each schema has
-- its own relay and channel). A setting someone else writes to that name
-- can only cost a notification, never a row: the poll still finds it.
--
-- Cost. With the relay idle, a row costs the WHEN's current_setting and a
-- comparison (the first row of a queue also the look and a set_config);
-- with a relay of all queues awake, that and the look as in 007, and no
-- event. The function runs once per transaction and queue (once per change
-- of queue when rows of several queues alternate). Measured on a loaded
-- 2-core machine, one INSERT of 10,000 rows, relay idle: COMMIT 0.3-0.6ms
-- (007: 147-155ms; no trigger: 0.2ms), the whole transaction 119-132ms
-- (007: 263-284ms; no trigger: 106-109ms). Backend CPU for 100,000 rows:
-- idle 1.17-1.19s (007: 1.19-1.22s plus 1.47s at COMMIT; no trigger
-- 1.11s); awake 1.25s (007: 1.19s): the setting's look costs about 0.5us
-- a row while the relay is awake, and spares the lock's look, about 1us,
-- for every row after the first while it is idle. Other sources' tables
-- keep the trigger without WHEN (the function per row, with 1 and 2).
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

-- The trigger, with the WHEN of 3 (a, b, c). The lock's key and the
-- setting's name are computed here, as in 007: renaming the schema leaves
-- the key stale, which only makes every transaction queue the trigger.
DO $$
BEGIN
    EXECUTE format(
        'DROP TRIGGER IF EXISTS stagedrain_wake ON staged_jobs;
         CREATE CONSTRAINT TRIGGER stagedrain_wake
             AFTER INSERT ON staged_jobs
             DEFERRABLE INITIALLY DEFERRED
             FOR EACH ROW
             WHEN (current_setting(%2$L, true) IS DISTINCT FROM NEW.queue
                   AND pg_try_advisory_lock_shared(%1$s, pg_backend_pid() %% 16)
                   AND pg_advisory_unlock_shared(%1$s, pg_backend_pid() %% 16)
                   AND set_config(%2$L, NEW.queue, true) IS NOT NULL)
             EXECUTE FUNCTION stagedrain_wake()',
        hashtext('stagedrain-awake:' || current_schema()),
        'stagedrain.wake_' || 'staged_jobs'::regclass::oid);
END
$$;
