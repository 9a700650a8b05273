-- The schema at version 9, for fresh installs: what 001..009 leave, in one
-- file, for reading and for Migrate to apply to a schema that has neither
-- a stagedrain_migrations version nor a staged_jobs table. Migrate applies
-- wake_009.sql (the stagedrain_wake() function) first, then this file, and
-- records versions 1..9 under their files' names, as an upgrade does: a
-- fresh install and an upgrade have the same rows and the same catalog
-- (TestBaselineMatchesUpgrade compares them). Migrations above 9 are then
-- applied as usual, to both.
--
-- The file is never edited: a later migration is a file of its own, and a
-- later baseline (baseline_NNN.sql, with its own wake file) may replace
-- this one for fresh installs. Why each object is as it is lives in the
-- comments of the migration that made it (named below).

-- staged_jobs: rows an application INSERTs inside its own transaction; the
-- relay pushes committed rows to Redis and deletes them (001).
CREATE TABLE staged_jobs (
    id         BIGSERIAL PRIMARY KEY,
    job_name   TEXT  NOT NULL,
    job_args   JSONB NOT NULL,
    -- the Sidekiq queue (or asynq queue, or stream) the job goes to
    queue      TEXT NOT NULL DEFAULT 'default',
    -- NULL (or not in the future): run now; a future time: scheduled
    run_at     TIMESTAMPTZ,
    -- Sidekiq's job id, 24 lowercase hex characters, fixed at INSERT
    jid        TEXT NOT NULL DEFAULT substr(md5(gen_random_uuid()::text), 1, 24),
    created_at TIMESTAMPTZ NOT NULL DEFAULT statement_timestamp(),
    -- extra payload fields merged into the pushed job
    options    JSONB NOT NULL DEFAULT '{}',
    -- Reject, inside the app's own transaction, what no worker could run (001).
    CONSTRAINT staged_jobs_job_name_check CHECK (job_name <> ''),
    CONSTRAINT staged_jobs_queue_check CHECK (queue <> ''),
    CONSTRAINT staged_jobs_job_args_check CHECK (jsonb_typeof(job_args) = 'array'),
    CONSTRAINT staged_jobs_jid_check CHECK (jid <> ''),
    CONSTRAINT staged_jobs_options_check CHECK (jsonb_typeof(options) = 'object'
        AND NOT options ?| ARRAY['class', 'args', 'queue', 'jid', 'created_at', 'enqueued_at', 'at'])
);

-- Finite times (008). NOT VALID, as 008 adds them to a table that may hold
-- rows: on this empty table it changes nothing but the catalog, which is
-- kept identical to an upgraded schema's.
ALTER TABLE staged_jobs ADD CONSTRAINT staged_jobs_run_at_finite
    CHECK (run_at IS NULL OR isfinite(run_at)) NOT VALID;
ALTER TABLE staged_jobs ADD CONSTRAINT staged_jobs_created_at_finite
    CHECK (isfinite(created_at)) NOT VALID;

-- staged_jobs_dead: rows the relay can never push (poison), moved here in
-- the drain's own transaction (004).
CREATE TABLE staged_jobs_dead (
    id         BIGINT PRIMARY KEY,
    job_name   TEXT,
    job_args   JSONB,
    queue      TEXT,
    run_at     TIMESTAMPTZ,
    jid        TEXT,
    created_at TIMESTAMPTZ,
    options    JSONB,
    reason     TEXT        NOT NULL,
    failed_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    attempts   INT         NOT NULL
);

-- The wake trigger (009): runs stagedrain_wake() (wake_009.sql) at COMMIT,
-- once per transaction and queue, and only while a relay of all queues is
-- idle. The lock's key and the setting's name are computed here, from the
-- schema's name and the table's oid.
DO $$
BEGIN
    EXECUTE format(
        'CREATE CONSTRAINT TRIGGER stagedrain_wake
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
