-- A commit that finds no relay idle pays one lock look, and a small one.
--
-- 010's trigger asked, for every row, in its WHEN: is the schema's 'idle'
-- held, or the row's queue's? With no relay running, or a relay awake
-- (draining, its Redis down or hung), both answers are no, and the row
-- queues no event; but PostgreSQL does not keep a trigger's WHEN compiled
-- between statements: every INSERT reads the expression back from its
-- text form (stringToNode) and plans it again (ExecPrepareQual), and that
-- took most of the trigger's cost, in proportion to the expression's size,
-- not the looks themselves (perf, pgbench with the trigger on: 12% of the
-- server's CPU under ExecARInsertTriggers, most of it in stringToNode and
-- eval_const_expressions). 010's WHEN held two try-and-release pairs, the
-- queue's key built from NEW.queue, and the once-per-transaction setting's
-- two calls. Measured on one session, 40,000 one-row INSERTs in a DO loop,
-- nobody idle, the best of four rounds: no trigger 882-918 ms, 010's WHEN
-- 1,420-1,440 ms (+13 us a row), this WHEN 1,072-1,082 ms (+4 us).
-- pgbench, 16 clients, one-row INSERT transactions, no relay, three
-- rounds: 010's trigger kept 94% of the TPS with the trigger disabled,
-- this one 98%.
--
-- The WHEN now asks one question: is any relay of the schema idle? The
-- schema's 'idle' lock (hashtext('stagedrain-idle:<schema>'), 16 shards,
-- the shard pg_backend_pid() % 16) is taken by every idle relay: as
-- before, exclusively by a relay of all queues; and now shared by a relay
-- of a list of queues (Config.Queues), besides its queues' own 'idle'
-- locks, which it still takes exclusively. The two kinds never run on one
-- schema together (each refuses the other at start, relay/locks.go). The
-- WHEN tries 'idle' exclusively and releases it at once, in one
-- expression, as 009 did with 'awake':
--     NOT (pg_try_advisory_lock(k, s) AND pg_advisory_unlock(k, s))
-- is true while any relay holds the shard, in either mode, or waits for
-- it. Only then does it call stagedrain_wake_once(setting, queue), which
-- is 009's once-per-transaction-and-queue test (the setting's look, and
-- its set_config when the row is the first of its queue): a PL/pgSQL
-- function, so that the WHEN stays small (a SQL function would be inlined
-- into it, and parsed with it, every statement). The event then runs
-- stagedrain_wake() at COMMIT, unchanged (014), which asks the precise
-- questions: a relay of all queues idle (taking 'idle' shared fails: only
-- a relay of all queues holds it exclusively), or the row's queue's relay
-- idle. So a row whose queue's relay is awake, while another group's
-- relay is idle, now queues an event and runs the function, which does
-- not notify: the cost 010's WHEN spared it moves to the function, for
-- schemas split into groups, while one of them is idle.
--
-- The look can also fail for a moment when another commit of the same
-- shard is in the middle of its own (each takes the lock exclusively for
-- microseconds) or of stagedrain_wake()'s (shared); that row queues an
-- event, and the function finds nobody idle. It costs that commit the
-- function's run, never a notification.
--
-- Why no wake-up is missed. A row R of transaction T queues no event in
-- two cases:
--   - its look succeeded: at that moment, after T had its transaction id
--     (R is inserted), nobody held or waited for 'idle' on T's shard. Every
--     idle relay holds every shard of 'idle' (of either mode), taken
--     before it reads the transactions in progress, in the same round trip
--     (relay/wake.go): so every relay idle later took it after T's look,
--     and read the transactions in progress after that; T had then either
--     committed, and the drain that follows sees R, or is listed, and the
--     relay drains again when T ends (or leaves it to the fallback poll
--     past the poll's interval). This is 010's proof with one lock for
--     both kinds of relay.
--   - stagedrain_wake_once returned false: an earlier row of T, of the same
--     queue, queued the event (009, 3, case a, unchanged: the function
--     sets the setting only when it returns true, and the event is queued
--     exactly then, since the look came first; a rollback to a savepoint
--     discards both).
-- Rows that queue an event are 014's.
--
-- The function stagedrain_wake() is unchanged, and so is the trigger on
-- the sidekiq-staged_push gem's table (no WHEN). Relays of this release
-- need version 15: a relay of a list of queues from an older release takes
-- only its queues' locks, which this WHEN does not look at, so its commits
-- would never notify it (and it refuses a schema too new).
--
-- Recreating the trigger takes an ACCESS EXCLUSIVE lock on staged_jobs
-- for a moment (Migrate's lock_timeout, 5s, as 009).
CREATE OR REPLACE FUNCTION stagedrain_wake_once(setting text, queue text) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    -- An earlier row of this queue in this transaction queued the event.
    IF current_setting(setting, true) IS NOT DISTINCT FROM queue THEN
        RETURN false;
    END IF;
    PERFORM set_config(setting, queue, true);
    RETURN true;
END
$$;

-- The app's INSERT runs stagedrain_wake_once (the WHEN) and
-- stagedrain_next_id (011, the id's default) with the app's role, so it
-- needs EXECUTE on both; PostgreSQL checks it as it prepares the
-- expression, for every INSERT, whether the function is then called or
-- not. It grants EXECUTE to PUBLIC when a function is created, unless the
-- database's default privileges revoke that (ALTER DEFAULT PRIVILEGES ...
-- REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC, for the role that migrates):
-- then every INSERT failed on stagedrain_next_id since 011
-- (TestAppStagesWhereExecuteIsNotGrantedByDefault). Neither function reads
-- or writes anything but the caller's own setting or sequence.
-- (stagedrain_last_id, SECURITY DEFINER, is the relay's, and stays as it
-- is.)
GRANT EXECUTE ON FUNCTION stagedrain_wake_once(text, text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION stagedrain_next_id(regclass) TO PUBLIC;

DO $$
BEGIN
    EXECUTE format(
        'DROP TRIGGER IF EXISTS stagedrain_wake ON staged_jobs;
         CREATE CONSTRAINT TRIGGER stagedrain_wake
             AFTER INSERT ON staged_jobs
             DEFERRABLE INITIALLY DEFERRED
             FOR EACH ROW
             WHEN (NOT (pg_try_advisory_lock(%1$s, pg_backend_pid() %% 16)
                        AND pg_advisory_unlock(%1$s, pg_backend_pid() %% 16))
                   AND stagedrain_wake_once(%2$L, NEW.queue))
             EXECUTE FUNCTION stagedrain_wake()',
        hashtext('stagedrain-idle:' || current_schema()),
        'stagedrain.wake_' || 'staged_jobs'::regclass::oid);
END
$$;
