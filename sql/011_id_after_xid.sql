-- A staged row's default id is drawn only after its transaction has a
-- transaction id, so that the relay can tell when every id up to a value
-- is drained (relay/lowwater.go) and start its claims there, instead of at
-- the index's start.
--
-- Why. A session that holds the xmin horizon back (pg_dump's REPEATABLE
-- READ snapshot, a report, a replica with hot_standby_feedback) keeps every
-- row the relay deletes in the id index: no scan may mark it dead while
-- that session might still see it. A claim that scans from the index's
-- start walks them all, a heap fetch each, so each claim cost more than the
-- one before (2,000 jobs/s: p50 2.7 -> 39.6 ms in 40 s). A claim must start
-- below any id that may still commit, and ids are not commit order: a
-- transaction draws id 5, a later one draws 6 and commits first.
--
-- The invariant. With this default, a row's transaction T takes its
-- transaction id (pg_current_xact_id()) before nextval() gives the row its
-- id. So when the relay reads the sequence's last value S, every
-- transaction holding a default id <= S already has a transaction id,
-- smaller than that of any transaction that takes one later. Once a
-- snapshot's xmin passes the next transaction id as seen after S was read,
-- each such T has committed (its rows visible) or aborted (its rows never
-- will be). relay/lowwater.go gives the proof of the mark built on it.
--
-- The cost to the app: about 1,900 CPU instructions per row, 4% of a bare
-- one-row INSERT transaction's 48,000 (sql/README.md gives the
-- measurement); the transaction id is one the INSERT would have taken a
-- moment later anyway. An id the app sets itself bypasses the default;
-- the relay's probe finds such a row (relay/lowwater.go, within about 6 s).
--
-- The sequence must hand out one value at a time (CACHE 1, BIGSERIAL's):
-- with a per-session cache, a value is handed out long after the sequence
-- moved past it. The relay checks this, and the default, when it starts,
-- and claims from the index's start when either is not so.
--
-- One SQL expression, which PostgreSQL inlines into the INSERT (EXPLAIN
-- VERBOSE shows the CASE, no function call): a CASE evaluates its WHEN
-- before its THEN, and both calls are volatile, so neither is folded or
-- moved. A PL/pgSQL body (PERFORM, then RETURN) cost about 8 times as
-- much per row (sql/README.md).
CREATE OR REPLACE FUNCTION stagedrain_next_id(seq regclass) RETURNS bigint
LANGUAGE sql VOLATILE AS $$
    SELECT CASE WHEN pg_current_xact_id() IS NOT NULL THEN nextval(seq) END
$$;

-- The relay reads the sequence's last value through this function: it is
-- granted nothing on the sequence (cmd/stagedrain/README.md, GRANT), and
-- pg_sequence_last_value() needs SELECT or USAGE on it. It reads that one
-- sequence and nothing else, NULL before its first value.
DO $$
DECLARE
    seq text := pg_get_serial_sequence('staged_jobs', 'id');
BEGIN
    IF seq IS NULL THEN
        RAISE NOTICE 'staged_jobs.id has no sequence of its own: the relay claims from the index''s start';
        RETURN;
    END IF;
    EXECUTE format($f$
        CREATE OR REPLACE FUNCTION stagedrain_last_id() RETURNS bigint
        LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
        AS %L$f$, format('SELECT pg_sequence_last_value(%L::regclass)', seq));
    EXECUTE format('ALTER TABLE staged_jobs ALTER COLUMN id SET DEFAULT stagedrain_next_id(%L::regclass)', seq);
END
$$;
