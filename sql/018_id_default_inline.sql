-- staged_jobs.id's default written out as 011's expression itself, instead
-- of a call of stagedrain_next_id(), which PostgreSQL inlined into every
-- INSERT at the cost of parsing the function's body again each time.
--
-- Why. PostgreSQL inlines a one-expression SQL function while it plans a
-- statement (inline_function): it reads the function's catalog row, parses
-- and analyses its body text, then substitutes the argument. An INSERT
-- sent as a plain query (pgbench's default, an app without prepared
-- statements, any app behind PgBouncer in transaction pooling mode) is
-- planned for every execution, so it paid that parse for every row's
-- transaction. Measured on this project's 2-core machine (2026-12-05): one
-- pgbench session, 20,000 one-row INSERT transactions, the server's CPU per
-- transaction read from the postmaster's reaped children (cutime, cstime),
-- trigger disabled, three rounds: 116-133 us with stagedrain_next_id(seq),
-- 107-115 us with this default, 101-114 us with a plain nextval(seq). With
-- -M prepared (the plan kept) the first two were equal: 83.5 and 84.5 us.
-- Beside a running relay the app's 16 pgbench writers got about 9% fewer
-- INSERTs into 017's table than into the previous release's, and the relay
-- paid for it in smaller batches (issue 23).
--
-- The invariant is 011's, unchanged: a CASE evaluates its WHEN before its
-- THEN, so the row's transaction takes its transaction id before
-- nextval() gives the row its id (relay/lowwater.go gives the proof). This
-- is the expression 011's function was inlined into (EXPLAIN VERBOSE
-- showed exactly this CASE), so every INSERT does the same work, minus the
-- parse. It calls no function of ours, so the app's role needs no EXECUTE
-- grant for it either.
--
-- Only a default that is still 011's is replaced: one the app set itself,
-- or a table with no sequence of its own on id, is left as it is (the
-- relay then claims from the id index's start, and says so, as before).
-- stagedrain_next_id() stays: a default or an app may still name it, and
-- the relay accepts it too. ALTER COLUMN ... SET DEFAULT takes an ACCESS
-- EXCLUSIVE lock on staged_jobs for a moment, waited for at most 5s
-- (lock_timeout, as 009); it rewrites nothing.
DO $$
DECLARE
    seq text := pg_get_serial_sequence('staged_jobs', 'id');
BEGIN
    IF seq IS NULL THEN
        RETURN;
    END IF;
    -- 011's default: a call of stagedrain_next_id() that depends on the
    -- column's own sequence (pg_get_expr prints names as the search_path
    -- sees them, so the text alone is not compared).
    IF NOT EXISTS (
        SELECT FROM pg_attrdef d JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
        WHERE d.adrelid = 'staged_jobs'::regclass AND a.attname = 'id'
            AND pg_get_expr(d.adbin, d.adrelid) LIKE '%stagedrain_next_id(%'
            AND EXISTS (SELECT FROM pg_depend p
                WHERE p.classid = 'pg_attrdef'::regclass AND p.objid = d.oid
                    AND p.refclassid = 'pg_class'::regclass AND p.refobjid = seq::regclass))
    THEN
        RETURN;
    END IF;
    EXECUTE format('ALTER TABLE staged_jobs ALTER COLUMN id SET DEFAULT '
        'CASE WHEN pg_current_xact_id() IS NOT NULL THEN nextval(%L::regclass) END', seq);
END
$$;
