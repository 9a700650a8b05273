-- gem_002: stagedrain_staged_push_last_id() in PL/pgSQL, as 017 made
-- stagedrain_last_id() for staged_jobs: every claim of the low-water mark
-- calls it once, and PostgreSQL parsed and planned gem_001's SQL body again
-- at every call (it cannot inline a SECURITY DEFINER function); PL/pgSQL
-- keeps the plan for the session (017 has the measurement: about 35 us a
-- claim). Same name, result, SECURITY DEFINER and search_path: CREATE OR
-- REPLACE keeps its owner and grants. The rest is gem_001's, unchanged:
-- Migrate installs the newest gem file whole, on a table of gem_001 (its
-- trigger's comment, "stagedrain_gem 1") as on a new one, and the trigger
-- and its function are created only where missing or replaced alike.
--
-- gem_001's notes follow.
--
-- On the sidekiq-staged_push gem's table, a row's default id is drawn only
-- after its transaction has a transaction id, as 011 does for staged_jobs,
-- so that the relay claims from its low-water mark there too
-- (relay/lowwater.go): a session that holds the xmin horizon back no
-- longer makes each claim walk every row deleted since.
--
-- Why not 011's default. The gem's table belongs to the app's Rails
-- migrations: a default of stagedrain_next_id() would go into the app's
-- db/schema.rb, which does not dump functions, so `db:schema:load` would
-- fail wherever stagedrain never ran (a developer's machine, the app's CI).
-- The id column stays as the gem made it (bigserial).
--
-- Instead, a BEFORE INSERT ... FOR EACH STATEMENT trigger takes the
-- transaction id. PostgreSQL fires it before the statement evaluates the
-- first row's defaults (ModifyTable fires the statement's BEFORE triggers
-- before it reads its first row), so invariant (I) of relay/lowwater.go
-- holds for every default id: a transaction T holding a default id i got
-- its transaction id before the sequence handed out i. That holds for
-- INSERT ... VALUES, INSERT ... SELECT, ON CONFLICT and COPY FROM, each
-- checked by TestGemXidFirstBeforeDefault. The transaction id is one the
-- INSERT would take a moment later anyway: nextval() alone does not take
-- one (only the first value of each 32 it logs does), which is the window
-- this closes. An id drawn outside the INSERT (nextval() called by hand,
-- then given), like an id the app sets, is found by the relay's probe
-- (about 6 s). So is a row inserted with session_replication_role =
-- replica, under which this trigger does not fire.
--
-- The cost to the app: one PL/pgSQL call per INSERT statement, not per row
-- (cmd/stagedrain/README.md gives the measurement).
--
-- Migrate with relay.WithSource(relay.SourceSidekiqStagedPush) runs this
-- file with the search_path set to the schema, once per version: the
-- trigger's comment records it, "stagedrain_gem N". The relay uses the mark
-- only when the trigger is there and enabled, the id's default is
-- nextval() of a sequence with CACHE 1, and
-- stagedrain_staged_push_last_id() exists; else it claims from the index's
-- start, as before, and says so at start.
CREATE OR REPLACE FUNCTION stagedrain_xid_first() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_current_xact_id();
    RETURN NULL;
END
$$;

DO $$
DECLARE
    seq text := pg_get_serial_sequence('sidekiq_staged_push_jobs', 'id');
BEGIN
    IF NOT EXISTS (SELECT FROM pg_trigger
                   WHERE tgrelid = 'sidekiq_staged_push_jobs'::regclass AND tgname = 'stagedrain_xid_first') THEN
        CREATE TRIGGER stagedrain_xid_first
            BEFORE INSERT ON sidekiq_staged_push_jobs
            FOR EACH STATEMENT EXECUTE FUNCTION stagedrain_xid_first();
    END IF;
    IF seq IS NULL THEN
        RAISE NOTICE 'sidekiq_staged_push_jobs.id has no sequence of its own: the relay claims from the index''s start';
        RETURN;
    END IF;
    -- The relay reads the sequence's last value through this function, as
    -- stagedrain_last_id() for staged_jobs (011): it is granted nothing on
    -- the sequence. It reads that one sequence and nothing else.
    EXECUTE format($f$
        CREATE OR REPLACE FUNCTION stagedrain_staged_push_last_id() RETURNS bigint
        LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
        AS %L$f$, format('BEGIN RETURN pg_sequence_last_value(%L::regclass); END', seq));
END
$$;
